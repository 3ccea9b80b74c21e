"""How a stage's forward runs under an activation policy (the policies themselves are
defined in pipeline.planning.activation_policies): "full" and "selective" recompute it block by
block (recompute.py), "offload" keeps its saved tensors in host memory (offload.py).
The activation policy pass (pipeline.execution.passes.activation_policy) applies them."""
