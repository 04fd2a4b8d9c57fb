"""What each kind of media is to a Gemma 4 model, in one table: the encoder that takes it, its
placeholder token, the processor outputs that carry it, and how a problem with it is worded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Modality:
    kind: str  # "image", "video" or "audio": also the content-item type in chat messages
    tower: str  # the encoder that takes it: "vision" or "audio"
    token_field: str  # the config field holding its placeholder token id
    arrays: tuple[str, str]  # the processor outputs for the model, one row per item (values, positions/mask)

    def unsupported(self) -> str:
        """Why a model without this encoder refuses it."""
        return f"this model has no {self.tower} tower: it cannot take {self.kind} input"


MODALITIES = {
    "image": Modality("image", "vision", "image_token_id", ("pixel_values", "image_position_ids")),
    "video": Modality("video", "vision", "video_token_id", ("pixel_values_videos", "video_position_ids")),
    "audio": Modality("audio", "audio", "audio_token_id", ("input_features", "input_features_mask")),
}


def supported(model) -> dict[str, bool]:
    """Which kinds of media ``model`` (a ``Gemma4Model``) takes."""
    towers = {"vision": model.has_vision, "audio": model.has_audio}
    return {kind: towers[m.tower] for kind, m in MODALITIES.items()}
