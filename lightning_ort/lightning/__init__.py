"""The Lightning side: the strategies, ``ORTCallback``, the options they share, the wrapping of a
LightningModule's networks, and the ``ort/*`` metrics.

* :mod:`.config`: :class:`~.config.ORTConfig`, the arguments of the strategies and the callback;
* :mod:`.wrapping`: which submodules are wrapped in :class:`~lightning_ort.ORTModule`, and wrapping them;
* :mod:`.callback`: :class:`~.callback.ORTCallback`;
* :mod:`.strategies`: the ``"ort"``, ``"ort_ddp"``, ``"ort_ddp_spawn"`` and ``"ort_fsdp"`` strategies;
* :mod:`.metrics`: the ``ort/*`` metrics, reduced across ranks in one collective.
"""
