# kimi-linear LocalAI backend. The first (default) target installs, as LocalAI's Dockerfile.python expects.
#   make            # ./venv + requirements for $(BUILD_TYPE)/$(CUDA_MAJOR_VERSION) (default cpu) + gRPC stubs
#   make test       # python -m pytest tests (TRITON_INTERPRET=1 without a GPU)
#   make run ADDR=127.0.0.1:50051   # serves MODEL (default: the embedded models/kimi-linear-tiny)
#   make demo                       # starts the server, loads MODEL, prints a streamed answer
ADDR ?= 127.0.0.1:50051
MODEL ?= models/kimi-linear-tiny
DEMO_PY ?= $(or $(KIMI_VENV),venv)/bin/python

.DEFAULT_GOAL := install

.PHONY: install
install:
	bash install.sh

.PHONY: kimi-linear
kimi-linear: install

.PHONY: protogen
protogen:
	bash install.sh --protogen

.PHONY: run
run:
	bash run.sh --addr $(ADDR) --model $(abspath $(MODEL))

.PHONY: demo
demo:
	$(DEMO_PY) tools/demo.py --model $(abspath $(MODEL))

.PHONY: test
test:
	bash test.sh

.PHONY: test-server
test-server:
	bash test.sh tests/server

.PHONY: protogen-clean
protogen-clean:
	$(RM) backend_pb2_grpc.py backend_pb2.py backend_pb2.pyi

.PHONY: clean
clean: protogen-clean
	rm -rf venv __pycache__ .pytest_cache
