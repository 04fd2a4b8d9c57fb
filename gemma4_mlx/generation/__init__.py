"""Generation: the request pipeline, the prefill and decode loop, streaming, and the chat engine."""
