"""ps_mcore.dropout's scan of a model's active dropouts: exact per mode, once per model and mode."""

from __future__ import annotations

import gc
import weakref

import torch

from ps_mcore import dropout
from ps_mcore.dropout import active_dropouts


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.hidden_dropout = 0.2  # a functional dropout's rate, as Megatron's layers keep it


def test_active_dropouts_found_once_per_mode_and_model_freed(monkeypatch):
    """The verl glue asks before every micro-batch: the scan (every attribute of every module)
    runs once per model and mode; eval mode, train mode again, an added and a replaced module
    each give the exact answer; the cache does not keep a model alive."""
    scans = []
    scan = dropout._scan_rates
    monkeypatch.setattr(dropout, "_scan_rates", lambda m: scans.append(1) or scan(m))
    model = torch.nn.Sequential(Block(), torch.nn.Dropout(0.1), torch.nn.Linear(4, 4))

    train = active_dropouts(model)
    assert [(s.name, s.p) for s in train] == [("0.hidden_dropout", 0.2), ("1", 0.1)]
    assert active_dropouts(model) == train and len(scans) == 1
    assert active_dropouts(model.eval()) == [] and len(scans) == 2
    assert active_dropouts(model.train()) == train and len(scans) == 2
    model[0].eval()  # one module's mode: a mode of its own
    assert [s.name for s in active_dropouts(model)] == ["1"] and len(scans) == 3
    model.train().add_module("3", torch.nn.Dropout(0.3))
    assert [s.name for s in active_dropouts(model)] == ["0.hidden_dropout", "1", "3"] and len(scans) == 4
    model[1] = torch.nn.Dropout(0.5)  # a module replaced: same count, same flags, a new rate
    assert [(s.name, s.p) for s in active_dropouts(model)][1] == ("1", 0.5) and len(scans) == 5

    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None


def test_a_module_at_a_reused_address_is_scanned_again():
    """A module freed and a new one made at its address must not be taken for the old one:
    the cache holds the scanned modules themselves (weakly), not their addresses."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.0))
    assert active_dropouts(model) == []
    scans = dropout._FOUND[model]
    # what an address-keyed cache would see after the dropout is replaced by one at its address
    scans.modules[2] = weakref.ref(torch.nn.Dropout(0.0))  # dead at once: the old module is gone
    model[1].p = 0.4  # the module at that position now drops
    assert [(s.name, s.p) for s in active_dropouts(model)] == [("1", 0.4)]
