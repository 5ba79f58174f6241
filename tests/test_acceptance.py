import torch

from dspark.engine.acceptance import greedy_accept, rejection_sample


def test_greedy_accept_respects_lengths():
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    tokens = torch.tensor([[1, 2, 3], [1, 9, 3], [5, 6, 7]])
    acc = greedy_accept(target, tokens, torch.tensor([3, 3, 1]))
    assert acc.n_accepted.tolist() == [3, 1, 1]
    assert acc.next_token.tolist() == [4, 2, 6]


def test_rejection_sample_exact_distribution():
    """Marginal of the first committed token equals p_1 exactly, summing over draft x and uniform u."""
    p1 = torch.tensor([0.5, 0.3, 0.2])
    q1 = torch.tensor([0.2, 0.2, 0.6])
    V = 3
    grid = (torch.arange(2000) + 0.5) / 2000  # quadrature over u
    total = torch.zeros(V)
    for x in range(V):
        n = len(grid)
        p = torch.stack([p1, torch.tensor([1.0, 0, 0])]).expand(n, 2, V)  # p_2 irrelevant here
        acc = rejection_sample(p, q1.expand(n, 1, V), torch.full((n, 1), x), torch.ones(n, dtype=torch.long),
                               grid.unsqueeze(1))
        first = torch.where(acc.n_accepted.unsqueeze(1) == 1, torch.nn.functional.one_hot(torch.tensor(x), V).float(),
                            acc.next_probs)
        total += q1[x] * first.mean(0)
    assert torch.allclose(total, p1, atol=2e-3)


def test_point_mass_drafts_and_zero_length():
    p = torch.tensor([[[0.6, 0.4], [0.1, 0.9]]])
    acc = rejection_sample(p, None, torch.tensor([[1]]), torch.tensor([1]), torch.tensor([[0.5]]))
    assert acc.n_accepted.tolist() == [0]  # 0.5 >= p(1) = 0.4: rejected
    assert torch.allclose(acc.next_probs, torch.tensor([[1.0, 0.0]]))  # residual removes the drafted token
    acc = rejection_sample(p, None, torch.tensor([[1]]), torch.tensor([0]), torch.tensor([[0.0]]))
    assert acc.n_accepted.tolist() == [0] and torch.allclose(acc.next_probs, p[:, 0])
