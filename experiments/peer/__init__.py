"""Peers: other libraries' eviction methods, run on the same token ids and budgets.

``kvpress_peer`` drives NVIDIA kvpress in its own virtual environment (kvpress needs an
older transformers than pagekv); import it explicitly::

    from experiments.peer import kvpress_peer
"""
