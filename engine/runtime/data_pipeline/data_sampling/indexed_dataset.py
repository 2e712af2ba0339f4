"""`deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset`'s path under deepfleet: the index files'
reader under DeepSpeed's name (`deepfleet.engine.indexed_dataset`)."""

from deepfleet.engine.indexed_dataset import IndexedRows as MMapIndexedDataset  # noqa: F401 - DeepSpeed's path
