"""DDTree as vLLM 0.26's speculative method "ddtree" (V1 model runner, CPU attention so far).

``patches.register`` is the ``vllm.general_plugins`` entry point; ``runtime`` holds the step;
``cpu_tree_attention`` the tree-masked attention and KV commit. Map: docs/integration.md.
"""
