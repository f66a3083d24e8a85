# Entry points; the build itself is CMake (see CMakeLists.txt).
BUILD    ?= build
SANBUILD ?= build-asan
TSANBUILD ?= build-tsan
JOBS     ?= $(shell nproc)
CMAKE_FLAGS ?=
# The project's own builds treat warnings as errors (a plain CMake build does not).
DEV_FLAGS := -DKVW_DEVELOPER=ON
# Tests that run threads of the library (contexts, transports). The TSan build leaves UCX
# out: under TSan the cross-process UCX cases slow past their timeouts (UCX 1.13 needs
# UCX_MEM_EVENTS=no there at all); the UCX transport's tests run in the release and
# ASan/UBSan builds.
TSAN_TESTS ?= test_api_masks|test_auth|test_ctrl_burst|test_ctx_metrics|test_gpu_staged|test_log_hook|test_bootstrap|test_metadata|test_multi_instance|test_peer_reap|test_proto_fail|test_streaming|test_transport

.PHONY: all deps build demo check check-fast check-asan check-tsan bench gpu-check gpu-bench clean sglang-check

all: build

deps:
	@scripts/install-deps.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(DEV_FLAGS) $(CMAKE_FLAGS)

# The second configure turns the developer option on in a build directory made before
# it existed (the cache keeps every other setting).
build: deps $(BUILD)/CMakeCache.txt
	cmake -S . -B $(BUILD) $(DEV_FLAGS) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

# The demo builds quietly: the build's output goes to $(BUILD)/demo-build.log, and only
# its errors and warnings (with the log's last lines) show when it fails.
# DEMO_ARGS: options for kvwire demo (kvwire demo --help), e.g.
# make demo DEMO_ARGS="--transport tcp --prefill-tp 2".
DEMO_ARGS ?=
demo: deps
	@mkdir -p $(BUILD)
	@echo "== make demo: building $(BUILD) (log: $(BUILD)/demo-build.log)"
	@{ { [ -f $(BUILD)/CMakeCache.txt ] || \
	     cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(DEV_FLAGS) $(CMAKE_FLAGS); } && \
	   cmake -S . -B $(BUILD) $(DEV_FLAGS) && \
	   cmake --build $(BUILD) -j $(JOBS) --target kvwire_cli; } >$(BUILD)/demo-build.log 2>&1 || \
	 { grep -v -E 'make\[[0-9]+\]: (Entering|Leaving) directory' $(BUILD)/demo-build.log | \
	     grep -E -i -A3 'error|warning' | head -60 | grep . || tail -20 $(BUILD)/demo-build.log; \
	   echo "make demo: the build failed (the whole log: $(BUILD)/demo-build.log)"; exit 1; }
	@echo "== make demo: kvwire demo $(DEMO_ARGS)"
	@$(BUILD)/kvwire demo $(DEMO_ARGS)

# All tests: a release build, then the same tests under ASan + UBSan, then the threaded
# tests under TSan.
check: build
	@echo "== make check 1/3: release build, every test ($$(date +%T))"
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)
	@echo "== make check 2/3: ASan + UBSan build, every test ($$(date +%T))"
	$(MAKE) check-asan
	@echo "== make check 3/3: TSan build, the threaded tests ($$(date +%T))"
	$(MAKE) check-tsan
	@echo "== make check: all three passed ($$(date +%T))"

check-fast: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

check-asan: deps
	cmake -S . -B $(SANBUILD) -DCMAKE_BUILD_TYPE=Debug -DKVW_SANITIZE=address,undefined -DKVW_WITH_CUDA=OFF $(DEV_FLAGS) $(CMAKE_FLAGS)
	cmake --build $(SANBUILD) -j $(JOBS)
	# As many tests at once as there are cores: sanitized test timeouts are three times
	# the release ones (tests/timeout.h), which two make check runs side by side on a
	# 2-core machine showed to be enough.
	# UCX's memory-event hooks make LeakSanitizer's exit-time tracer crash (SIGSEGV in the
	# tracer, every byte verified) in processes that opened a ucx context: off here, as in
	# the TSan run.
	cd $(SANBUILD) && UCX_MEM_EVENTS=no ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 KVW_SANITIZED=1 \
		ctest --output-on-failure -j $(JOBS)

check-tsan: deps
	cmake -S . -B $(TSANBUILD) -DCMAKE_BUILD_TYPE=Debug -DKVW_SANITIZE=thread -DKVW_WITH_CUDA=OFF -DKVW_WITH_UCX=OFF $(DEV_FLAGS) $(CMAKE_FLAGS)
	cmake --build $(TSANBUILD) -j $(JOBS)
	cd $(TSANBUILD) && UCX_MEM_EVENTS=no KVW_SANITIZED=1 TSAN_OPTIONS=halt_on_error=1 \
		ctest --output-on-failure -j $(JOBS) -R '$(TSAN_TESTS)'

bench: build
	$(BUILD)/bench_plan

clean:
	rm -rf $(BUILD) $(SANBUILD) $(TSANBUILD)

# GPU verification and benchmark (skip with a message where no GPU exists).
gpu-check:
	scripts/gpu-check.sh

gpu-bench:
	scripts/gpu-bench.sh

# Fuzzing: builds fuzz/ with clang -fsanitize=fuzzer,address,undefined and runs each
# target for FUZZ_SECONDS (scripts/fuzz.sh; non-zero exit on any crash or report).
FUZZ_SECONDS ?= 60
.PHONY: fuzz
fuzz:
	scripts/fuzz.sh $(FUZZ_SECONDS)

# Soak: bounded multi-process run on loopback (scripts/soak.sh): fault soakers and
# prefill/decode demo pairs for SOAK_SECONDS; fails on lost or corrupted rooms or on
# memory growth. A CI-sized run: make soak SOAK_SECONDS=15
SOAK_SECONDS ?= 60
.PHONY: soak
soak: build
	SOAK_SECONDS=$(SOAK_SECONDS) BUILD=$(BUILD) scripts/soak.sh

# Sweep: randomized `kvwire demo` configurations (scripts/sweep.sh): presets, TP 1-16 and
# PP 1-3 per side, page sizes 1-256, NHD/HND, shm/tcp/ucx, request shapes. Each run is
# verified, refused (with the reason), failed, crashed or hung; fails on any of the last
# three and prints their command lines. Without SWEEP_SEED the seed comes from the clock
# (printed). CI-sized by default (20 small runs, well under 2 minutes); at length:
#   make sweep SWEEP_SEED=7 SWEEP_RUNS=2000 SWEEP_ARGS="--max-pairs 2304 --max-tokens 2048 --timeout 300"
SWEEP_RUNS ?= 20
SWEEP_SEED ?=
SWEEP_ARGS ?=
.PHONY: sweep
sweep: build
	BUILD=$(BUILD) scripts/sweep.sh --runs $(SWEEP_RUNS) $(if $(SWEEP_SEED),--seed $(SWEEP_SEED)) $(SWEEP_ARGS)

# SGLang's own disaggregation scheduler code (prefill.py, decode.py, ... loaded unmodified
# from SGLANG_SRC, an SGLang checkout's python/ directory) driving kvwire.sglang, every
# byte checked (python/tests/sglang_real/run.py). Without SGLANG_SRC it says so and passes.
SGLANG_SRC ?=
sglang-check:
	@if [ -z "$(SGLANG_SRC)" ]; then \
		echo "sglang-check: skipped: SGLANG_SRC is not set (an SGLang source tree's python/ directory)"; \
	elif [ ! -f "$(SGLANG_SRC)/sglang/srt/disaggregation/prefill.py" ]; then \
		echo "sglang-check: skipped: no SGLang source at $(SGLANG_SRC) (sglang/srt/disaggregation/prefill.py missing)"; \
	else \
		$(MAKE) build && \
		py=python3; $$py -c 'import numpy' 2>/dev/null || py=/usr/bin/python3; \
		KVWIRE_LIB=$(abspath $(BUILD))/libkvwire.so $$py python/tests/sglang_real/run.py "$(SGLANG_SRC)"; \
	fi
