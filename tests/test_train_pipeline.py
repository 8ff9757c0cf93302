

def test_optimizer_state_reads_the_form_it_was_written_in(tmp_path):
    """An AdamW state written with indexed param groups (before the flattened form) still loads: match_saved picks
    the form from the keys; the flattened form names every group entry by parameter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from kimi_tools.train.weights import OptimizerState

    def fresh():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
        return m, torch.optim.AdamW([{"params": [m[0].weight]}, {"params": [m[0].bias, *m[1].parameters()]}])

    m, opt = fresh()
    m(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    for flatten, name in ((False, "indexed"), (True, "flat")):
        st = OptimizerState(m, opt)
        st.flatten = flatten
        dcp.save({"optimizer": st}, checkpoint_id=str(tmp_path / name), no_dist=True)
        keys = set(FileSystemReader(str(tmp_path / name)).read_metadata().state_dict_metadata)
        assert any(k.startswith("optimizer.param_groups.0.") for k in keys) == (not flatten), keys
        m2, opt2 = fresh()
        st2 = OptimizerState(m2, opt2)
        st2.match_saved(keys)
        assert st2.flatten == flatten
        dcp.load({"optimizer": st2}, checkpoint_id=str(tmp_path / name), no_dist=True)
        for p, p2 in zip(m.parameters(), m2.parameters()):
            assert torch.equal(opt.state[p]["exp_avg"], opt2.state[p2]["exp_avg"]), name
