"""`ffl-serve`: an OpenAI-compatible HTTP server (Starlette + uvicorn + sse-starlette) over
`OptimizedInferenceEngine`. Needs the `serve` extra: `pip install ffl_backend[serve]`.

    openai_api.py   request bodies -> GenerationRequest; reply objects
    generation.py   one request's choices merged, stop strings, deadlines, cancellation
    completions.py  the two generation routes (JSON and server-sent events)
    state.py        settings, engine, admission, tokenizing off the event loop
    transport.py    header deadline, JSON protocol errors, bounded body reads
    metrics.py      Prometheus /metrics
    app.py          the Starlette app: routes, API key, CORS, access log
    cli.py          `ffl-serve`: arguments, loading while serving /health, signals
"""
