"""OpenAI-compatible HTTP on the coordinator, one room per concern:

- `app.py`: the FastAPI app and its endpoints; `serve_http` starts it.
- `protocol.py`: the request bodies (pydantic); `convert.py`: a body to the `GenerateRequest`.
- `handler.py`: one request's choices run and its answer shaped (JSON or SSE); `fan_in.py`: the n > 1
  choices' streams into one queue; `sse.py`: server-sent event framing; `logprobs.py`: OpenAI's shapes.
- `errors.py`: OpenAI error objects and the HTTP status of each refusal; `front.py`: what the
  endpoints need from the coordinator.
"""
