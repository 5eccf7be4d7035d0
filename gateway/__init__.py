"""The gateway: OpenAI HTTP API and gRPC Generate in front of the pools (one per base model).

    service        entry point: gRPC and HTTP on one event loop
    config         GatewayConfig (flags; keys from files or the environment)
    pools          pools and their cells (schedulers): roster, probes, rendezvous choice
    frontend       the request path both faces share: caller, route, prompt, rate limit, stream
    grpc_service   the scheduler's Generate contract
    openai_api     the OpenAI-compatible HTTP endpoints (Starlette)
    tgi_api        the TGI/LoRAX-style endpoints (/generate, /generate_stream, /)
    http_common    bearer key, bounded JSON bodies, server-sent events
    openai_requests, openai_responses, http_errors   OpenAI bodies, events and errors
    chat           chat templates, rendered as HF transformers renders them
    catalog        the adapters a tenant may use (/v1/models)
    metrics        Prometheus metrics
"""
