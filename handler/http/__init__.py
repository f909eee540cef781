"""The HTTP front door: a Flask app under gunicorn serving one function per worker process.

serve.py          `snapfn serve`: gunicorn (gthread workers), each worker inits or restores
serve_config.py   how it listens and what the app accepts (`ServeConfig`)
gunicorn.conf.py  gunicorn's settings and hooks
workers.py        gunicorn's workers, answering the requests gunicorn itself refuses in JSON
arbiter.py        gunicorn's arbiter, replacing a worker that was up whatever its exit code
receive_deadline.py  a deadline on each request's headers and body arriving (then a 408)
app.py            the Flask app (`create_app`): /invoke, OpenAI routes, /tokenize, health, metrics
openai/           OpenAI-compatible requests (models, validation) and responses, vLLM's tokenize
generation.py     one OpenAI request's engine streams, read out whole or as SSE
openapi.py        the published OpenAPI document (`GET /openapi.json`)
json_io.py        JSON in and out (bounded, valid Unicode), errors included
startup_gate.py   requests that need the runtime wait for it, boundedly, or get a 503
api_key.py        the bearer API key (shared with the activator)
metrics.py        the Prometheus metrics, every gunicorn worker's together
"""
