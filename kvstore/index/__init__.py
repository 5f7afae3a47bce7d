"""The global block index: the contract (``base``), the backends (``memory``, ``redis``) and the
factory that picks one from a config (``factory``, the only module that names backends).
"""
