"""DDTree's glue for vLLM 0.26's V2 model runner (``vllm/v1/worker/gpu/``), the CUDA default:
full CUDA graphs and async scheduling.

- ``speculator``: vLLM's DFlash speculator drafting D positions, the trees built inside its
  graph, the accepted paths handed to it as context; owns the per-engine tree tables;
- ``prepare``: which requests verify a tree this step, their depth positions;
- ``sampler``: the target's token at every node (vLLM's sampler), the walk, the KV commit;
- the target's attention: ``attention.paged_tree_kernel``, recorded in the verify graphs.
"""
