"""LocalAI gallery metadata: gallery/backend-index.yaml (backend gallery), gallery/images.yaml (image builds),
gallery/kimi-linear.yaml (model gallery), checked against the fields LocalAI reads
(core/gallery/backend_types.go GalleryBackend, metadata_type.go Metadata, models_types.go GalleryModel,
core/config ModelConfig) and against this backend (name, LoadModel options, requirement profiles)."""

import os
import re
import subprocess

import pytest

yaml = pytest.importorskip("yaml")  # pyyaml, in requirements-test.txt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND_NAME = "kimi-linear"
REGISTRY, MIRROR = "quay.io/go-skynet/local-ai-backends", "localai/localai-backends"
# capability keys LocalAI's pkg/system/capabilities.go can report (+ "default")
KNOWN_CAPABILITIES = {"default", "cpu", "nvidia", "nvidia-cuda-12", "nvidia-cuda-13", "nvidia-l4t",
                      "nvidia-l4t-cuda-12", "nvidia-l4t-cuda-13", "amd", "intel", "metal", "vulkan", "darwin-x86"}
REQUIRED_CAPABILITIES = {"nvidia-cuda-12", "nvidia-cuda-13", "nvidia-l4t-cuda-13", "cpu"}
# yaml keys of GalleryBackend / GalleryModel (+ inline Metadata)
BACKEND_KEYS = {"name", "alias", "uri", "version", "mirrors", "capabilities", "sha256", "url", "description",
                "license", "urls", "icon", "tags", "files", "size"}
MODEL_KEYS = {"name", "url", "urls", "description", "license", "icon", "tags", "files", "size", "config_file",
              "overrides", "variants", "last_checked", "backend"}
# model YAML keys used here that LocalAI's core/config ModelConfig reads (yaml tags)
MODEL_CONFIG_KEYS = {"backend", "context_size", "dtype", "trust_remote_code", "gpu_memory_utilization", "parameters",
                     "template", "function", "options", "engine_args", "known_usecases", "artifacts", "max_model_len",
                     "grpc", "stopwords"}
KIMI_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": -1, "min_p": 0.01, "repeat_penalty": 1}


def load(name):
    with open(os.path.join(ROOT, "gallery", name), encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def backends():
    entries = load("backend-index.yaml")
    assert isinstance(entries, list) and entries
    return {e["name"]: e for e in entries}


@pytest.fixture(scope="module")
def images():
    rows = load("images.yaml")["include"]
    return {r["tag-suffix"]: r for r in rows}


@pytest.fixture(scope="module")
def models():
    entries = load("kimi-linear.yaml")
    assert isinstance(entries, list) and entries
    return {e["name"]: e for e in entries}


def profile_of(build_type, cuda_major):
    """install.sh's own BUILD_TYPE/CUDA_MAJOR_VERSION -> profile mapping (getBuildProfileStandalone)."""
    src = open(os.path.join(ROOT, "install.sh")).read()
    fn = re.search(r"^getBuildProfileStandalone\(\) \{.*?^\}", src, re.S | re.M).group(0)
    env = {k: v for k, v in os.environ.items() if k not in ("BUILD_TYPE", "CUDA_MAJOR_VERSION")}
    env.update(BUILD_TYPE=build_type, CUDA_MAJOR_VERSION=cuda_major)
    return subprocess.run(["bash", "-c", fn + "\ngetBuildProfileStandalone"], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


# ------------------------------------------------------------------------------------------------ backend gallery

def test_backend_entries_have_localai_fields(backends):
    assert len(backends) == len(load("backend-index.yaml")), "duplicate names"
    for name, e in backends.items():
        assert set(e) <= BACKEND_KEYS, (name, set(e) - BACKEND_KEYS)
        assert isinstance(name, str) and re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name), name
        for key in ("license", "description", "icon"):
            assert isinstance(e[key], str) and e[key].strip(), (name, key)
        assert isinstance(e["urls"], list) and all(isinstance(u, str) and u.startswith("https://") for u in e["urls"])
        assert isinstance(e["tags"], list) and all(isinstance(t, str) for t in e["tags"])
        caps = e["capabilities"]
        assert isinstance(caps, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in caps.items())


def test_meta_entry_maps_capabilities_to_images(backends):
    meta = {n: e for n, e in backends.items() if e.get("capabilities") and not e.get("uri")}  # GalleryBackend.IsMeta
    assert set(meta) == {BACKEND_NAME, BACKEND_NAME + "-development"}
    assert meta[BACKEND_NAME]["alias"] == BACKEND_NAME
    for name, e in meta.items():
        caps = e["capabilities"]
        assert REQUIRED_CAPABILITIES <= set(caps) <= KNOWN_CAPABILITIES, (name, set(caps))
        dev = name.endswith("-development")
        for cap, target in caps.items():
            assert target in backends, f"{name}: capability {cap} -> {target}, which is not an entry"
            concrete = backends[target]
            assert concrete.get("uri"), f"{target} is not a concrete image entry"
            assert target.endswith("-development") == dev, (name, target)
            # LocalAI: backends whose name/uri contain l4t only run where the capability starts with nvidia-l4t
            if "l4t" in target or "l4t" in concrete["uri"]:
                assert cap.startswith("nvidia-l4t"), (cap, target)
        assert "l4t" in caps["nvidia-l4t-cuda-13"] and "arm64" in caps["nvidia-l4t-cuda-13"]
        assert "cuda12" in caps["nvidia-cuda-12"] and "cuda13" in caps["nvidia-cuda-13"]
        assert caps["cpu"].startswith("cpu-")


def test_concrete_entries_name_built_images(backends, images):
    concrete = {n: e for n, e in backends.items() if e.get("uri")}
    assert len(concrete) == 2 * len(images)  # every image: a latest (release) and a master (development) entry
    for name, e in concrete.items():
        m = re.fullmatch(re.escape(REGISTRY) + r":(latest|master)(-.+)", e["uri"])
        assert m, e["uri"]
        channel, suffix = m.groups()
        assert suffix in images, f"{name}: {suffix} is not built by gallery/images.yaml"
        assert (channel == "master") == name.endswith("-development"), name
        assert e["mirrors"] == [f"{MIRROR}:{channel}{suffix}"], name


def test_image_builds_match_profiles(images):
    assert os.path.isfile(os.path.join(ROOT, "Dockerfile"))
    want = {"cpu": "linux/amd64", "cublas12": "linux/amd64", "cublas13": "linux/amd64", "l4t13": "linux/arm64"}
    seen = {}
    for suffix, r in images.items():
        assert r["backend"] == BACKEND_NAME and suffix.endswith("-" + BACKEND_NAME)
        assert r["dockerfile"] == "./Dockerfile" and r["context"] == "./"
        profile = profile_of(r["build-type"], r["cuda-major-version"])
        seen[profile] = r
        assert os.path.isfile(os.path.join(ROOT, f"requirements-{profile}.txt")), profile
        assert r["platforms"] == want[profile], (profile, r["platforms"])
        if profile != "cpu":
            assert r["cuda-minor-version"].isdigit() and r["skip-drivers"] == "false"
    assert set(seen) == set(want)
    # LocalAI's tag-suffix conventions for the three NVIDIA shapes (.github/backend-matrix.yml)
    assert seen["cublas12"]["tag-suffix"] == "-gpu-nvidia-cuda-12-" + BACKEND_NAME
    assert seen["cublas13"]["tag-suffix"] == "-gpu-nvidia-cuda-13-" + BACKEND_NAME
    assert seen["l4t13"]["tag-suffix"] == "-nvidia-l4t-cuda-13-arm64-" + BACKEND_NAME
    assert seen["l4t13"]["build-type"] == "l4t" and seen["l4t13"]["base-image"] == "ubuntu:24.04"


# ------------------------------------------------------------------------------------------------ model gallery

def test_model_entries_have_localai_fields(models):
    for name, e in models.items():
        assert set(e) <= MODEL_KEYS, (name, set(e) - MODEL_KEYS)
        assert re.fullmatch(r"[a-z0-9][a-z0-9.:-]*", name), name
        assert e["url"].startswith(("github:", "https://")), e["url"]
        for key in ("description", "license"):
            assert isinstance(e[key], str) and e[key].strip(), (name, key)
        assert all(isinstance(u, str) and u.startswith("https://") for u in e["urls"])
        assert all(isinstance(t, str) for t in e["tags"])
        assert isinstance(e["overrides"], dict)
        assert set(e["overrides"]) <= MODEL_CONFIG_KEYS, set(e["overrides"]) - MODEL_CONFIG_KEYS
        for f in e.get("files", []):   # LocalAI's File: filename (relative), sha256, uri
            assert set(f) == {"filename", "sha256", "uri"}, f
            assert not os.path.isabs(f["filename"]) and ".." not in f["filename"].split("/")
            assert re.fullmatch(r"[0-9a-f]{64}", f["sha256"]), f
            assert f["uri"].startswith(("https://", "huggingface://", "hf://", "github:", "oci://")), f


def test_instruct_entry(models, backends):
    e = models["kimi-linear-48b-a3b-instruct"]
    o = e["overrides"]
    assert o["backend"] == BACKEND_NAME and o["backend"] in backends
    assert o["parameters"]["model"] == "moonshotai/Kimi-Linear-48B-A3B-Instruct"
    assert "https://huggingface.co/moonshotai/Kimi-Linear-48B-A3B-Instruct" in e["urls"]
    assert isinstance(o["context_size"], int) and 0 < o["context_size"] <= 1048576
    assert o["template"] == {"use_tokenizer_template": True}   # Messages + Tools rendered by the backend
    assert o["function"]["grammar"]["disable"] is True
    for k, v in KIMI_SAMPLING.items():   # LocalAI's "kimi" inference defaults
        assert o["parameters"][k] == v, k
    assert "chat" in o["known_usecases"]
    assert "tool_parser:kimi_k2" in o["options"]
    (art,) = o["artifacts"]
    assert art["name"] == "model" and art["target"] == "model"
    assert art["source"]["type"] == "huggingface" and art["source"]["repo"] == o["parameters"]["model"]


def test_overrides_load_without_unknown_options(models, tmp_path):
    """The overrides become ModelOptions the way LocalAI maps them; our LoadModel parsing accepts all of them."""
    pb = pytest.importorskip("backend_pb2")
    from backend.options import build_load_spec

    snapshot = tmp_path / "snapshot"   # stands in for the artifact snapshot LocalAI passes as ModelFile
    snapshot.mkdir()
    for name, e in models.items():
        o = e["overrides"]
        req = pb.ModelOptions(Model=o["parameters"]["model"], ModelFile=str(snapshot), ModelPath=str(tmp_path),
                              ContextSize=o["context_size"], DType=o.get("dtype", ""),
                              TrustRemoteCode=bool(o.get("trust_remote_code")),
                              GPUMemoryUtilization=float(o.get("gpu_memory_utilization", 0)),
                              Options=list(o.get("options", [])))
        spec = build_load_spec(req)
        assert spec.ignored == [], (name, spec.ignored)
        assert spec.model_dir == str(snapshot) and spec.model_name == o["parameters"]["model"]
        assert spec.engine["max_model_len"] == o["context_size"]
        assert spec.engine["dtype"] == "bfloat16"
