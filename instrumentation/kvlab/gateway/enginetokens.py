"""Tokens-in, tokens-out: the gateway takes prompt token ids from the engine itself.

For a model whose tokenizer the gateway cannot load (custom code, a tokenizer that only exists
in the engine's image), `kvlab gateway --tokenize-via engine` asks a healthy replica: chats go
to vLLM's render endpoint (`/v1/chat/completions/render`, served with `--enable-scale-out`), which
returns exactly the ids the engine would run, and to `/tokenize` where the engine has no render
endpoint; completion prompts go to `/tokenize`. Answers are cached (bounded LRU) by the request's
tokenization fields, so a repeated prompt costs no round trip. A request the engine's template
rejects is answered 400 with the engine's message; no replica reachable is a 503.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import aiohttp
import msgspec

from kvlab.errors import NoEndpointAvailable, RequestError
from kvlab.gateway.endpoints import Registry

ENGINE = "engine"
RENDER_PATH = "/v1/chat/completions/render"
_NO_ENDPOINT = {403, 404, 405, 501}   # scale-out endpoints disabled, or an engine without them


class EngineTokens:
    source = ENGINE

    def __init__(self, model: str | None = None, max_entries: int = 10_000, timeout_s: float = 10.0) -> None:
        self.model = model
        self.max_entries = max_entries
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self.registry: Registry | None = None
        self._cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._no_render: set[str] = set()   # replicas without the render endpoint
        self._next = 0

    def bind(self, session: aiohttp.ClientSession, registry: Registry) -> None:
        self.session, self.registry = session, registry

    async def encode_text(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], int]:
        return await self._ids({"prompt": text, "add_special_tokens": add_special_tokens}, chat=False)

    async def encode_chat(self, messages: Any, tool_choice: Any = None, **kwargs: Any) -> tuple[list[int], int]:
        kwargs["tool_choice"] = tool_choice
        return await self._ids({"messages": messages, **{k: v for k, v in kwargs.items() if v is not None}},
                               chat=True)

    async def _ids(self, body: dict[str, Any], chat: bool) -> tuple[list[int], int]:
        key = msgspec.json.encode(body, order="sorted")
        ids = self._cache.get(key)
        if ids is not None:
            self._cache.move_to_end(key)
            return list(ids), len(ids)
        if self.model:
            body = {"model": self.model, **body}
        got = await self._ask(body, chat)
        self._cache[key] = tuple(got)
        if len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return got, 0

    async def _ask(self, body: dict[str, Any], chat: bool) -> list[int]:
        assert self.session is not None and self.registry is not None, "bind() first"
        replicas = self.registry.candidates()
        if not replicas:
            raise NoEndpointAvailable("no healthy replica to tokenize with")
        self._next += 1
        order = replicas[self._next % len(replicas):] + replicas[:self._next % len(replicas)]
        last = "no replica tried"
        for r in order:
            try:
                if chat and r.name not in self._no_render:
                    status, data = await self._post(r.url + RENDER_PATH, {**body, "max_tokens": 1})
                    if status not in _NO_ENDPOINT:
                        return self._tokens(status, data, "token_ids")
                    self._no_render.add(r.name)
                status, data = await self._post(r.url + "/tokenize", body)
                return self._tokens(status, data, "tokens")
            except (TimeoutError, aiohttp.ClientError) as exc:
                last = f"{r.name}: {type(exc).__name__}: {exc}"
        raise NoEndpointAvailable(f"no replica could tokenize the prompt ({last})")

    async def _post(self, url: str, body: dict[str, Any]) -> tuple[int, Any]:
        assert self.session is not None
        async with self.session.post(url, data=msgspec.json.encode(body), timeout=self.timeout,
                                     headers={"Content-Type": "application/json"}) as resp:
            raw = await resp.read()
        try:
            return resp.status, msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return resp.status, {"error": {"message": raw[:200].decode(errors="replace")}}

    @staticmethod
    def _tokens(status: int, data: Any, field: str) -> list[int]:
        if status == 200 and isinstance(data, dict) and isinstance(data.get(field), list):
            tokens: list[int] = data[field]
            return tokens
        if status == 200 and isinstance(data, list) and data and isinstance(data[0], dict):
            return data[0].get(field) or []
        err = data.get("error") if isinstance(data, dict) else None
        msg = err.get("message") if isinstance(err, dict) else (data.get("message") if isinstance(data, dict) else None)
        if 400 <= status < 500:
            raise RequestError(f"the engine could not tokenize the request: {msg or status}")
        raise aiohttp.ClientResponseError(None, (), status=status, message=str(msg))  # type: ignore[arg-type]
