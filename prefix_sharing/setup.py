"""``prefix_sharing.setup``: the patchset controls next to the activating import.

    import prefix_sharing.setup as setup
    setup.detect()                             # patchset -> available, or not available (why)
    setup.install(setup.requested_patchsets()) # PREFIX_SHARING_PATCHSET, or every compatible one
    setup.uninstall()                          # verl exactly as before

The same functions as :mod:`ps_mcore.setup` (re-exported, not copies). Importing this module
imports :mod:`prefix_sharing`, which installs the requested patchsets first (idempotent).
"""

from ps_mcore.setup import detect, install, installed, requested_patchsets, uninstall

__all__ = ["detect", "install", "installed", "requested_patchsets", "uninstall"]
