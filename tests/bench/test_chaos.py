"""A short chaos run in `make test`: `kvtier bench chaos --model tiny` on the serve graph (two
mixed instances at TP 2, a file L3), about a minute of conversations and adversarial clients
while a rank, the namespace actor, and the namespace actor with its state lost are killed
(one fault of each kind). Every target must be met: no wrong answer, no server error, no
instance lost, nothing leaked on any rank."""
from __future__ import annotations

import json

import pytest

import kvtier.cli.main as cli
from kvtier.bench.chaos import TARGETS, fault_kinds
from kvtier.policies import StorageBackendKind

pytestmark = pytest.mark.timeout(900)


def test_a_short_chaos_run_meets_every_target(capsys):
    rc = cli.main(["bench", "chaos", "--model", "tiny", "--minutes", "0.75", "--l3", "file",
                   "--request-timeout", "60", "--settle", "30", "--seed", "1", "--json"])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines, f"the chaos run printed no result (rc {rc}); its stderr:\n{captured.err[-4000:]}"
    result = json.loads(lines[-1])
    kinds = {kind.value for kind in fault_kinds(StorageBackendKind.FILE, pd=False)}
    assert set(result["faults_injected"]) == kinds, result["faults"]  # each kind, armed
    assert result["sent"] > 0 and result["checked"] > 0 and result["refused_4xx"] > 0
    assert result["tenant_probes"] > 0  # two tenants asked one document: none shared
    assert result["unaccounted"] == 0
    why = {k: result[k] for k in ("missed", "lost", "faults", "error_kinds",
                                  "error_samples_before_faults", "wrong_samples", "audit_error")}
    assert {name: result[name] for name in TARGETS} == dict.fromkeys(TARGETS, 0), why
    assert rc == 0 and result["missed"] == []
