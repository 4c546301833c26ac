"""benchmarks/gan_loop.py in its smoke mode: both settings measured and recorded (not the figures), and the
discriminator's plan held over the timed steps all resident ([Note: reads the plan did not foresee])."""

import json


def test_gan_loop_smoke(tmp_path):
    import gan_loop

    path = tmp_path / "gan_loop.json"
    assert gan_loop.main(["--smoke", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["benchmark"] == "gan_loop" and data["smoke"]
    results = {r["setting"]: r for r in data["results"]}
    assert set(results) == {"resident", "streamed"}
    for r in results.values():
        assert r["engine_step_ms"] > 0 and r["torch_step_ms"] > 0
    resident = results["resident"]["discriminator_over_timed_steps"]
    assert resident["plan_departures"] == 0 and resident["replans"] == 0, resident
    assert resident["fast_steps"] > 0, resident
