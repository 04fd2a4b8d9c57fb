import sys

if "--step" in sys.argv[1:]:  # one decode step, counted (bench/step.py)
    from .step import main

    main([a for a in sys.argv[1:] if a != "--step"])
elif "--speculative" in sys.argv[1:]:  # speculative decoding with a drafter (bench/speculative.py)
    from .speculative import main

    main([a for a in sys.argv[1:] if a != "--speculative"])
elif "--long" in sys.argv[1:]:  # long contexts: memory and speed (bench/long.py)
    from .long import main

    main([a for a in sys.argv[1:] if a != "--long"])
else:
    from .speed import main

    main()
