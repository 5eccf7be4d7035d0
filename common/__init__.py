"""The shared layer beneath the services: what more than one of them needs, and nothing that
belongs to one of them.

    errors        exceptions bound to gRPC status codes; the one exception-to-status mapping
    server        gRPC server bootstrap (health, reflection, graceful stop); client channels
                  that present a key on every call
    credentials   keys -> callers (tenant, service, admin), read from files or the environment
    adapter_ref   AdapterRef (one immutable version, name@version) and AdapterQuery (what a
                  client writes), with the rules for names, aliases and versions
    sampling      SamplingParams: one type, one validator, one conversion from and to the proto
    peft/         the PEFT LoRA format: what the store validates and executors load
    metrics       Prometheus plumbing
    allocator     glibc malloc settings for processes that stream adapter bytes
    wire          metadata keys and values the protos do not carry
    registry_client  cached adapter resolution (scheduler and gateway)
    ratelimit     per-tenant token buckets (scheduler and gateway)
    prompt_bounds a model's prompts as token ids, checked to fit its context (ModelPrompts;
                  the gateway's and a scheduler's); the fewest tokens a text can be
    generate_pb   a Generate request's max_new_tokens, output processor (stop ids with EOS)
                  and Usage: one reading for the gateway and a scheduler's own Generate

Layers point down only: protos/ and common/ import no service; scheduler/, executor/ and
adapter_store/, gateway/ import protos, common and their own package (the executor also
kernels/);
kernels/ imports only torch and triton; the applications (loraplex/: CLI, client, demo,
launcher, budget, training, fixtures) import anything.
tests/common/test_layers.py holds the rule.
"""
