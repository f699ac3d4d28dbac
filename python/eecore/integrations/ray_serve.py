"""eecore's OpenAI server as a Ray Serve deployment: replicas of the engine behind Ray's router,
fixed in number or autoscaled (`pip install "eecore[ray]"`; docs/distributed.md).

    from ray import serve
    from eecore.integrations.ray_serve import openai_deployment

    app = openai_deployment({"model": "path/or/file.gguf"}, num_replicas=2)
    serve.run(app, route_prefix="/")        # OpenAI's API on Ray's HTTP port (8000)

or from a shell, `serve run eecore.integrations.ray_serve:app_builder model=path num_replicas=2`.

Each replica is one eecore engine (its own `LLM`, tensor-parallel inside if the options say so)
serving eecore's own app: the same endpoints, limits, errors and streaming as `eecore serve`. A
replica that dies loses the requests it was running; Ray restarts it and routes new requests to
the live ones.
"""
# (no `from __future__ import annotations`: FastAPI must see the route's Request type itself)

from typing import Any, Optional

from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import Response

_shell = FastAPI()  # Ray's ingress: every path goes to the replica's own eecore app


class _ToApp(Response):
    """A response that is the inner app's whole answer to the request (its body read, streamed)."""

    def __init__(self, app):  # noqa: D107 (no body of its own)
        self.app = app
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


@serve.ingress(_shell)
class EecoreReplica:
    def __init__(self, llm_options: dict, served_model_name: Optional[str] = None,
                 api_key: Optional[list[str]] = None, server_options: Optional[dict] = None):
        import eecore
        from eecore.serve import AsyncEngine, build_app
        from eecore.serve.app import default_model_name

        self.llm = eecore.LLM(**llm_options)
        self.engine = AsyncEngine(self.llm, **(server_options or {}))
        self.eecore_app = build_app(self.engine, served_model_name or default_model_name(llm_options.get("model")),
                             api_key=api_key)
        self._started = False

    @_shell.api_route("/{path:path}", methods=["GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH"],
                      include_in_schema=False)
    async def forward(self, request: Request, path: str) -> Response:
        if not self._started:  # the engine's deltas go to the replica's event loop
            self.engine.start()
            self._started = True
        return _ToApp(self.eecore_app)

    def __del__(self):
        if getattr(self, "_started", False):
            self.engine.stop(timeout=1.0)
        if hasattr(self, "llm"):
            self.llm.shutdown()


def openai_deployment(llm_options: dict, *, num_replicas: Any = 1, served_model_name: Optional[str] = None,
                      api_key: Optional[list[str]] = None, server_options: Optional[dict] = None,
                      ray_actor_options: Optional[dict] = None, **deployment_options):
    """The bound Ray Serve application: `num_replicas` replicas (or "auto", with
    `autoscaling_config=...` among `deployment_options`), each an LLM(**llm_options) behind
    eecore's app. `server_options` go to eecore.serve.AsyncEngine (the queue's bounds)."""
    if not isinstance(llm_options, dict):
        raise TypeError(f"openai_deployment: 'llm_options' must be a dict of LLM options, got {type(llm_options).__name__}")
    deployment = serve.deployment(EecoreReplica, name="eecore", num_replicas=num_replicas,
                                  ray_actor_options=ray_actor_options or {"num_cpus": 1}, **deployment_options)
    return deployment.bind(llm_options, served_model_name, api_key, server_options)


def app_builder(args: dict):
    """For `serve run eecore.integrations.ray_serve:app_builder model=... num_replicas=2`."""
    args = dict(args)
    replicas = args.pop("num_replicas", 1)
    return openai_deployment(args, num_replicas=replicas if replicas == "auto" else int(replicas))
