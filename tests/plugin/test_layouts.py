"""Which KV cache layouts the plugin drives, and the start-up refusal of the others.

The driven layouts (``harness.SUPPORTED_LAYOUTS``) are exercised step by step against vLLM in
``test_stock_equality.py``; here, each is accepted as vLLM builds it, and a layout with a
manager the pool does not model stops start-up with a message naming the layout.
"""

from __future__ import annotations

import pytest
from harness import REFUSED_LAYOUTS, SUPPORTED_LAYOUTS, make_manager

from arc_evictor.vllm_plugin import patches
from arc_evictor.vllm_plugin.version import UnsupportedVllmError

BS = 4


@pytest.mark.parametrize("layout", SUPPORTED_LAYOUTS)
def test_supported_layout_gets_one_policy_pool_for_every_group(layout: str) -> None:
    manager = make_manager("arc", 32, BS, layout=layout)
    singles = manager.coordinator.single_type_managers
    assert len(singles) == len(layout.split("+"))
    assert {id(single.block_pool) for single in singles} == {id(manager.block_pool)}
    assert all(type(single) in patches.SUPPORTED_MANAGERS for single in singles)


@pytest.mark.parametrize("layout", REFUSED_LAYOUTS)
def test_unsupported_layout_is_refused_naming_the_layout(layout: str) -> None:
    with pytest.raises(UnsupportedVllmError, match=r"layout is \[FullAttentionSpec/") as error:
        make_manager("lru", 32, BS, layout=layout)
    assert "MambaSpec/MambaManager" in str(error.value)
    assert "MambaManager unsupported" in str(error.value)


def test_unsupported_layout_runs_on_vllms_own_pool() -> None:
    # Without the plugin (policy None) vLLM builds the same layout as usual.
    manager = make_manager(None, 32, BS, layout=REFUSED_LAYOUTS[0])
    assert len(manager.coordinator.single_type_managers) == 2
