"""pytest plugin (``-p tests.helpers.throwaway.plugin``): registers the throwaway family before collection, so
that every per-family test module, evaluated at import, sees it in the registries."""

from __future__ import annotations


def pytest_configure(config) -> None:
    from mcore.models.families import register_family
    from tests.helpers.throwaway import ministral_family

    register_family(ministral_family)
    try:
        from mcore.bridge.mappings import register_mapping
    except ImportError:  # a models-only environment: the bridge tests are not collected there either
        return
    from tests.helpers.throwaway import ministral_mapping

    register_mapping(ministral_mapping.MAPPING)
