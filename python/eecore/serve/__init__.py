"""`eecore serve`: an OpenAI-compatible server (FastAPI + uvicorn) over an async engine.

    from eecore.serve import AsyncEngine, build_app
    app = build_app(AsyncEngine(eecore.LLM(), max_waiting=256), model_name="SmolLM2-135M-Instruct")

The HTTP layer (app.py, protocol.py, responses.py) parses, validates and streams; one engine
thread (async_engine.py) owns the LLMEngine; metrics.py exports Prometheus metrics.
"""
from eecore.serve.app import build_app, default_model_name
from eecore.serve.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "build_app", "default_model_name"]
