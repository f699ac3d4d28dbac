"""eecore's OpenAI app as a Ray Serve deployment: two CPU replicas on a local Ray cluster answer 32
concurrent `openai` clients with nothing lost, and keep answering after one replica is killed."""
from __future__ import annotations

import asyncio
import os

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from model_factory import make_tiny_hf_model  # noqa: E402
from serve_utils import free_port  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("ray"), num_layers=2)
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    from eecore.integrations.ray_serve import openai_deployment

    options = {"model": path, "dtype": "float32", "device": "cpu", "num_blocks": 256, "block_size": 8,
               "max_num_seqs": 16}
    serve.run(openai_deployment(options, num_replicas=2, ray_actor_options={"num_cpus": 0.5}), route_prefix="/")
    yield path, f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


async def _ask(client, name: str, i: int) -> str:
    r = await client.completions.create(model=name, prompt=f"Hello {i}", max_tokens=8, temperature=0)
    return r.choices[0].text


def _many(url: str, name: str, n: int) -> list:
    import openai

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        return await asyncio.gather(*[_ask(client, name, i) for i in range(n)], return_exceptions=True)

    return asyncio.run(run())


def test_two_replicas_answer_32_clients_and_survive_a_killed_replica(cluster):
    path, url = cluster
    name = os.path.basename(path)
    answers = _many(url, name, 32)
    assert not [a for a in answers if isinstance(a, BaseException)], answers
    assert len(answers) == 32 and all(isinstance(a, str) for a in answers)
    # the same prompt gets the same greedy answer from either replica
    assert _many(url, name, 4)[:1] == answers[:1]

    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "eecore" in a["name"]
                and "SERVE_REPLICA" in a["name"]]
    assert len(replicas) == 2, replicas
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]), no_restart=False)
    after = _many(url, name, 16)
    failed = [a for a in after if isinstance(a, BaseException)]
    assert len(failed) < 16  # at most the killed replica's in-flight requests are lost
    again = _many(url, name, 16)  # and new requests succeed
    assert not [a for a in again if isinstance(a, BaseException)], again
