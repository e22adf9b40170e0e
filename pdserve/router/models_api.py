"""The OpenAI HTTP front's model endpoints: ``GET /v1/models`` and ``/v1/models/{id}`` (the
base model under each served name, then each LoRA adapter, with ``parent`` the base model
and ``root`` its path, as vLLM lists them), and vLLM's run-time adapter endpoints
``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` (``pdserve.router.lora_admin``: every
worker of both pools; 200 once every live worker holds it, or none does; admin callers only,
and only with ``--allow-runtime-lora-updating``).
"""

from __future__ import annotations

from aiohttp import web

from pdserve.router.adapters import unknown_model
from pdserve.router.http_errors import HttpError, error_response
from pdserve.router.lora_admin import LoRAAdmin, may_administer
from pdserve.router.service import GenerationService
from pdserve.router.validation import decode_json


class ModelsFront:
    def __init__(self, service: GenerationService, admin: LoRAAdmin | None = None):
        """``admin``: the router's (``pdserve.router.server`` shares it with the pool's per-poll
        sync); None: one of this front's own over the service's pool, made at the first call."""
        self.service, self._admin = service, admin

    @property
    def admin(self) -> LoRAAdmin:
        if self._admin is None:
            m = self.service.model
            self._admin = LoRAAdmin(m.adapters, m.names, self.service.pool)
        return self._admin

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/models", self.models), web.get("/v1/models/{model_id:.+}", self.model_card),
                web.post("/v1/load_lora_adapter", self.load), web.post("/v1/unload_lora_adapter", self.unload)]

    def _card(self, name: str) -> dict:
        m = self.service.model
        card = {"id": name, "object": "model", "created": 0, "owned_by": "pdserve", "root": m.name, "parent": None,
                "max_model_len": m.max_model_len}
        adapter = m.adapters.get(name) if name not in m.names else None
        if adapter is not None:
            card.update(root=adapter.path, parent=m.name)
        return card

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [self._card(name) for name in self.service.model.served_names()]})

    async def model_card(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if not self.service.model.serves(model_id):
            return error_response(404, unknown_model(model_id, self.service.model.served_names()), "NotFoundError",
                                  "model")
        return web.json_response(self._card(model_id))

    async def load(self, request: web.Request) -> web.Response:
        try:
            body = await self._admin_body(request, ("lora_name", "lora_path"))
            await self.admin.load(body["lora_name"], body["lora_path"])
        except HttpError as exc:
            return error_response(exc.status, str(exc), exc.kind, exc.param)
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        try:
            body = await self._admin_body(request, ("lora_name",))
            await self.admin.unload(body["lora_name"])
        except HttpError as exc:
            return error_response(exc.status, str(exc), exc.kind, exc.param)
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    async def _admin_body(self, request: web.Request, required: tuple[str, ...]) -> dict:
        """The body of an admin call, once its caller may make it (403 otherwise) and each of
        ``required`` is a string in it (400 naming it otherwise)."""
        if not may_administer(self.service.keys, self.service.tenant_of(request.headers.get("Authorization"))):
            raise HttpError(403, "loading and unloading LoRA adapters needs an admin key: --api-key's, or a tenant "
                                 "with admin: true in --api-keys-file", "PermissionDeniedError")
        raw = await request.read()
        body = decode_json(raw) if raw else {}
        if not isinstance(body, dict):
            raise HttpError(400, "body must be a JSON object", param="body")
        for name in required:
            if not isinstance(body.get(name), str) or not body[name]:
                raise HttpError(400, f"{name}: required, a non-empty string", param=name)
        return body
