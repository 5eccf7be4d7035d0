"""The steps wing: what one executor runs and how each step is planned (step_builder.py states
the policy; reference_steps.py and fast_steps.py are its builders), its sequences, their KV blocks
(block_manager.py) and the prefix cache's names for them (prefix_cache.py, longrope.py)."""
