"""``GET /v1/models`` (and ``/models``) and ``GET /v1/models/{model}``.

The answer depends only on the served model name, the engine's context
(``max_model_len``, vLLM's field) and whether the model takes images
(``input_modalities``), the same for every alias: they all route to the one
model. A router without an engine serves the same routes, without the two
facts it does not know.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime.
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI

from server.http.errors import APIError
from server.openai.model_names import model_ids
from server.openai.protocol import ModelCard, ModelList, input_modalities


def add_model_routes(
    app: FastAPI,
    served_model_name: str,
    auth: Callable[..., Awaitable[str | None]],
    responses: dict[int | str, dict[str, Any]] | None = None,
    *,
    max_model_len: int | None = None,
    takes_images: bool | None = None,
) -> None:
    modalities = None if takes_images is None else input_modalities(takes_images)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, max_model_len=max_model_len, input_modalities=modalities)

    async def list_models(_: Annotated[str | None, Depends(auth)]) -> ModelList:
        return ModelList(data=[card(name) for name in model_ids(served_model_name)])

    async def retrieve_model(model: str, _: Annotated[str | None, Depends(auth)]) -> ModelCard:
        if model not in model_ids(served_model_name):
            raise APIError(404, "Model Not Exist", param="model")
        return card(model)

    for path, schema in (("/v1/models", True), ("/models", False)):
        app.add_api_route(
            path, list_models, methods=["GET"], responses=responses, include_in_schema=schema
        )
    app.add_api_route("/v1/models/{model}", retrieve_model, methods=["GET"], responses=responses)
