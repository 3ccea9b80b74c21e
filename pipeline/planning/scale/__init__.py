"""Planning a job for hardware this machine does not have: transformer families by size
(`transformer`), per-op pricing of captured units on meta tensors (`pricing`), memory per
GPU (`memory`), one layout's step time and memory (`predict`) and the search over layouts
(`search`), all on a `pipeline.planning.hardware.Target`."""
