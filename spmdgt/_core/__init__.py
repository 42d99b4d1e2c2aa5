"""The bottom layer: process-wide state every other layer reads, importing no other spmdgt
package (and not torch).

- ``scope``: this rank's stack of active signal scopes, and who listens to it (the compiled
  interceptor, the compile pass's lazy regions);
- ``env``: every ``GT_*`` environment variable, declared once and parsed by one rule (public
  as ``spmdgt.env``);
- ``debuglog``: ``GT_VERBOSE`` / ``GT_DEBUG_*`` status and debug lines;
- ``session``: the one object that owns resetting all of it (``spmdgt.session.reset()``).

Layers above it: ``runtime`` (ranks, process groups, agreement), ``config``, ``tensor`` and
``signal``, ``interceptor``, ``compile``, ``train``; each imports only from layers below it.
"""
