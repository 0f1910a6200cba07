"""DDTree's glue for vLLM 0.26's V1 model runner (``vllm/v1/worker/gpu_model_runner.py``), the
runner of vLLM's CPU build, one file per stage of the step:

``prepare`` (this step's trees, depth positions) -> the target's forward (``attention``) ->
``sample`` (target token per node, walk) -> ``commit`` (accepted K/V moved) -> ``propose``
(drafter context reordered, DFlash forward, next trees).
"""
