"""TLS on both APIs with certificates made for the run (tests/access/pki.py): the official
openai client over https trusting the test CA, a gRPC secure channel, mutual TLS refusing
clients without a certificate of that CA, plaintext clients refused cleanly while the server
keeps serving, and unusable TLS flags stopping the server with a message naming the flag."""

from __future__ import annotations

import ssl

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness import InProcessServer, ServerProcess
from service.proto.moeserve.v1 import inference_pb2 as pb
from service.proto.moeserve.v1 import inference_pb2_grpc
from service.settings import Settings
from service.tls import TlsConfigError, TlsFiles
from tests.access.conftest import settings

# ignore_eos: a sampled EOS would end the reply early (the tests count its tokens)
GENERATE = pb.GenerateRequest(
    prompt="hello", params=pb.SamplingParams(max_tokens=3, ignore_eos=True)
)


def _tls_settings(model_dir, pki, mutual: bool) -> Settings:
    return settings(
        model_dir,
        grpc_port=0,
        ssl_certfile=str(pki.server_cert),
        ssl_keyfile=str(pki.server_key),
        ssl_ca_certs=str(pki.ca) if mutual else None,
    )


@pytest.fixture(scope="module")
def tls_server(tiny_model_dir, pki):
    with InProcessServer(_tls_settings(tiny_model_dir, pki, mutual=False)) as srv:
        yield srv


@pytest.fixture(scope="module")
def mtls_server(tiny_model_dir, pki):
    with InProcessServer(_tls_settings(tiny_model_dir, pki, mutual=True)) as srv:
        yield srv


def _channel(target: str, pki, with_cert: bool = False, stranger: bool = False) -> grpc.Channel:
    key = cert = None
    if with_cert or stranger:
        name = "stranger" if stranger else "client"
        key = getattr(pki, f"{name}_key").read_bytes()
        cert = getattr(pki, f"{name}_cert").read_bytes()
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes(), key, cert)
    return grpc.secure_channel(target, creds)


def _assert_serving(srv, pki, with_cert: bool = False) -> None:
    """One completion over https and one Generate over the secure channel."""
    with httpx.Client(verify=pki.client_context(with_cert), timeout=30) as http:
        r = http.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    with _channel(srv.grpc_target, pki, with_cert) as channel:
        reply = inference_pb2_grpc.InferenceStub(channel).Generate(GENERATE, timeout=30)
        assert len(reply.token_ids) == 3


def test_openai_client_over_https_trusting_the_ca(tls_server, pki):
    assert tls_server.url.startswith("https://127.0.0.1:")
    http_client = httpx.Client(verify=pki.client_context())
    client = openai.OpenAI(
        base_url=tls_server.url + "/v1", api_key="unused", http_client=http_client, max_retries=0
    )
    model = tls_server.state.model_name
    # ignore_eos: the random-weight model may sample its EOS within a few tokens
    completion = client.completions.create(
        model=model, prompt="hello", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 4
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    # the probes and the scrape follow the same listener
    for path in ("/health", "/ready", "/metrics"):
        assert http_client.get(tls_server.url + path).status_code == 200, path
    # a client that does not trust the CA refuses the server's certificate
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(tls_server.url + "/health")


def test_grpc_secure_channel(tls_server, pki):
    with _channel(tls_server.grpc_target, pki) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        assert len(stub.Generate(GENERATE, timeout=30).token_ids) == 3
        chunks = list(stub.GenerateStream(GENERATE, timeout=30))
        assert chunks[-1].finish_reason == "length"
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_clients_are_refused_cleanly(tls_server, pki):
    plain_url = tls_server.url.replace("https://", "http://")
    for _ in range(3):
        with pytest.raises(httpx.TransportError):
            httpx.get(plain_url + "/health", timeout=10)
    with grpc.insecure_channel(tls_server.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            inference_pb2_grpc.InferenceStub(channel).Generate(GENERATE, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    _assert_serving(tls_server, pki)  # and nothing broke


def test_mutual_tls_requires_a_client_certificate_of_the_ca(mtls_server, pki):
    _assert_serving(mtls_server, pki, with_cert=True)
    for context in (pki.client_context(), pki.client_context(stranger=True)):
        with pytest.raises(httpx.TransportError):
            # TLS 1.3: the server's refusal arrives after the handshake, on the first read
            httpx.get(mtls_server.url + "/health", verify=context, timeout=10)
    for kwargs in ({}, {"stranger": True}):
        with _channel(mtls_server.grpc_target, pki, **kwargs) as channel:
            with pytest.raises(grpc.RpcError) as err:
                inference_pb2_grpc.InferenceStub(channel).Generate(GENERATE, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, kwargs
    _assert_serving(mtls_server, pki, with_cert=True)


def test_tls_flags_are_checked_before_serving(tmp_path, pki):
    def check(**flags):
        return TlsFiles.from_settings(Settings(**flags))

    assert check() is None
    files = check(ssl_certfile=str(pki.server_cert), ssl_keyfile=str(pki.server_key))
    assert files.mode == "tls" and files.uvicorn_options()["ssl_cert_reqs"] == ssl.CERT_NONE
    cases = {
        "--ssl-certfile needs --ssl-keyfile": {"ssl_certfile": str(pki.server_cert)},
        "--ssl-keyfile needs --ssl-certfile": {"ssl_keyfile": str(pki.server_key)},
        "--ssl-ca-certs needs --ssl-certfile": {"ssl_ca_certs": str(pki.ca)},
        "No such file": {"ssl_certfile": str(tmp_path / "nope.pem"), "ssl_keyfile": "x"},
        "KEY_VALUES_MISMATCH": {
            "ssl_certfile": str(pki.server_cert),
            "ssl_keyfile": str(pki.client_key),
        },
        "--ssl-ca-certs": {
            "ssl_certfile": str(pki.server_cert),
            "ssl_keyfile": str(pki.server_key),
            "ssl_ca_certs": str(pki.server_key),  # not a certificate
        },
    }
    for message, flags in cases.items():
        with pytest.raises(TlsConfigError, match=message):
            check(**flags)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (("--ssl-certfile", "{cert}"), "--ssl-certfile needs --ssl-keyfile"),
        (("--api-keys-file", "{missing}"), "cannot read"),
    ],
)
def test_unusable_tls_or_keys_files_stop_the_server_before_the_model_loads(
    tiny_model_dir, pki, tmp_path, flags, message
):
    paths = {"cert": pki.server_cert, "ca": pki.ca, "missing": tmp_path / "keys.json"}
    argv = [f.format(**paths) for f in flags]
    server = ServerProcess(tiny_model_dir, *argv, env={"OTEL_TRACES_EXPORTER": "none"}).start()
    try:
        assert server.proc.wait(120) == 2
    finally:
        server.stop()
    (failed,) = [r for r in server.records if r.get("event") == "startup failed"]
    assert message in failed["error"]
    assert not [r for r in server.records if r.get("event") == "loading weights"]
