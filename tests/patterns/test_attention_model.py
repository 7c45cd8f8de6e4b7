"""The main job's HSTUModel (reference spelling inside STU layers): attention rewritten per layer,
eager-equal outputs and parameter gradients."""
import torch

from hstu_inductor.reference import HSTUModel
from hstu_inductor.report import collecting
from _helpers import REWRITE_BACKEND


def test_hstu_model_attention_per_layer(fresh_dynamo):
    torch.manual_seed(0)
    model = HSTUModel(40, 8, embedding_dim=16, num_layers=2, num_heads=2, attn_dim=4, hidden_dim=4)
    offsets = torch.tensor([0, 5, 5, 13, 16])
    ids = torch.randint(0, 40, (16,))
    nt = torch.tensor([1, 0, 2, 1])
    compiled = torch.compile(model, backend=REWRITE_BACKEND)
    with collecting() as report:
        out = compiled(ids, offsets, nt)
    assert report.counts["attention"] == 2, report
    ref = model(ids, offsets, nt)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(ref)
    params = list(model.parameters())
    got = torch.autograd.grad(out, params, g)
    want = torch.autograd.grad(ref, params, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
