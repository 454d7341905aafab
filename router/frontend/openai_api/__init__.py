"""OpenAI's HTTP API as the ingress speaks it: request and response bodies (pydantic),
bodies <-> engine requests and outputs, the HTTP body reader and the SSE / JSON response,
vLLM's /tokenize endpoints, and structured-output request fields."""
