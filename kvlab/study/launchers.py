"""kvlab's own Hydra launcher plugins (hydra_plugins/kvlab_launchers/), made known to Hydra.

Hydra finds launchers by scanning the `hydra_plugins` namespace package; an editable install of
kvlab maps that package through an import hook the scan does not see, so `kvlab-run` registers
them itself (`Plugins.register`, Hydra's public way). A launcher whose upstream plugin is not
installed (hydra-ray-launcher: the `sweeps` extra) is left out.
"""

from __future__ import annotations


def register_launchers() -> list[str]:
    """Register kvlab's launchers with Hydra; their class names."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.kvlab_launchers.ray_cluster import KvlabRayLauncher, RayLauncher

    registered = []
    if RayLauncher is not None:
        Plugins.instance().register(KvlabRayLauncher)
        registered.append(f"{KvlabRayLauncher.__module__}.{KvlabRayLauncher.__name__}")
    return registered
