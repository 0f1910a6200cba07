"""Benchmarks: acceptance (tau) of the reference loop; engine benchmarks come later."""
