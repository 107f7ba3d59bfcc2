"""/v1/models: the card of the one model this server serves."""

from __future__ import annotations

import time

from updraft.serve.errors import APIError
from updraft.serve.models.protocol import ModelCard, ModelList


class ModelsServing:
    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.card = ModelCard(id=model_name, created=int(time.time()), max_model_len=max_model_len)

    def list(self) -> ModelList:
        return ModelList(data=[self.card])

    def get(self, model_id: str) -> ModelCard:
        card = self.card
        if model_id != card.id:
            raise APIError(
                404,
                f"model: {model_id[:200]!r} does not exist; this server serves {card.id!r}",
                param="model",
                code="model_not_found",
            )
        return card
