"""The LoRA wing: adapters in the executor. The slot pool and where each slot's pages sit in the KV
blocks (slot_pool.py, page_tables.py), an adapter read from PEFT bytes (peft_adapter.py), staged on
the host and copied into a slot (staged.py, slot_copy.py), the backends that add a step's adapter
contributions (backend.py: torch_backend.py with stack.py, triton_backend.py; segments.py,
experts.py), and one adapter merged into the base weights (merge.py)."""
