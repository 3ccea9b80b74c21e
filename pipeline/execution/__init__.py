"""Execution: the action interpreter and the executors that run a plan (local threads + CUDA
streams; distributed/ over torch.distributed)."""
