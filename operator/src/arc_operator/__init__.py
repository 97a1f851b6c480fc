"""The arc-serving operator: a kopf operator for the ``ServingPolicy`` custom resource.

Run it with ``arc-operator --all-namespaces`` (``python -m arc_operator``; see ``__main__``).
The package is named ``arc_operator`` because a package named ``operator`` would shadow the
standard library.
"""

from __future__ import annotations

GROUP = "arcserving.io"
VERSION = "v1alpha1"
KIND = "ServingPolicy"
PLURAL = "servingpolicies"
SINGULAR = "servingpolicy"
SHORT_NAMES = ("sp",)
FINALIZER = f"{GROUP}/finalizer"
FIELD_MANAGER = "arc-serving-operator"
