"""Integrations of epgen's ops with training frameworks: one module per framework, each importing that framework
(an optional dependency: nothing else in epgen imports these modules or the frameworks).

- ``runtime.integrations.torchtitan``: ``EpgenTokenDispatcher``, a torchtitan 0.3.0 MoE token dispatcher
  (docs/TORCHTITAN.md); ``pip install 'epgen[torchtitan]'``.
"""
