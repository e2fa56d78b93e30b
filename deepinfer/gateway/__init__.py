"""The OpenAI-compatible HTTP gateway: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`/tokenize`, `/detokenize`, `/health`, `/ready` and `/metrics`, in front of the mesh's router.

* `openai_requests` parses and validates request bodies into mesh requests (the parameters of
  `protocol.client.AsyncClient.generate/stream`), pure;
* `openai_responses` builds response objects, stream chunks and SSE frames from the mesh's records, pure;
* `errors` maps everything that can go wrong to OpenAI's error object and an HTTP status, pure;
* `app` is the Starlette application over one shared AsyncClient, thin; `server` runs it under uvicorn
  as the launcher's "gateway" role.

The gateway keeps no state beyond its connection to the router: several can run behind a load balancer.
"""
