# vllm-3x3090: vLLM 0.30.0 + the patches/ series, for 3x RTX 3090 (sm_86).
#
# The base image is pinned by tag; pin it by digest for reproducible builds:
#   docker build --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.30.0@sha256:8a69ffad015f138d7170c4ddc429e230a3bc1c1719f67e14324749df200a4b90 .
# (the multi-arch index digest a public mirror reports; verify it with
#  `docker buildx imagetools inspect vllm/vllm-openai:v0.30.0`).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.30.0
FROM ${VLLM_IMAGE}

# The apply step uses only stdlib Python (no git, no patch, no downloads).
COPY patches/ /opt/vllm-3x3090/patches/
# Only what runs in the image: the apply tool, and the serve-side tools
# (scripts/serve-tools/: make_ple_table.py, make_mtp_int4.py need the patched
# vllm modules) with the KV planner and its model config. The client tools
# (scripts/client/), developer tools and GPU bench kits run elsewhere
# (README "Tools, by who runs them") and stay out of the image.
COPY scripts/vllm_patches.py /opt/vllm-3x3090/scripts/vllm_patches.py
COPY scripts/kv_capacity.py /opt/vllm-3x3090/scripts/kv_capacity.py
COPY scripts/data/ /opt/vllm-3x3090/scripts/data/
COPY scripts/serve-tools/ /opt/vllm-3x3090/scripts/serve-tools/
COPY docker/entrypoint.sh /opt/vllm-3x3090/entrypoint.sh

# apply refuses a vllm other than 0.30.0, any file that differs from the
# wheel's RECORD, any hunk that needs an offset or fuzz, and a second apply;
# it dry-runs the whole series before writing, byte-compiles what it touched
# and records a manifest in vllm/_vllm_3x3090/. --check then re-verifies.
# SITE comes from find_spec, without importing vllm (that needs torch and a
# few seconds; tests/container builds this file on a base without torch).
RUN set -eux; \
    SITE="$(python3 -c 'import importlib.util as u, pathlib as p; print(p.Path(u.find_spec("vllm").origin).parents[1])')"; \
    python3 /opt/vllm-3x3090/scripts/vllm_patches.py --patches /opt/vllm-3x3090/patches apply "$SITE"; \
    python3 /opt/vllm-3x3090/scripts/vllm_patches.py --patches /opt/vllm-3x3090/patches apply --check "$SITE"; \
    chmod +x /opt/vllm-3x3090/entrypoint.sh

LABEL org.opencontainers.image.title="vllm-3x3090" \
      org.opencontainers.image.description="vLLM 0.30.0 patched for Qwen3.8-Flash-Next on 3x RTX 3090"

# Prints the manifest and the gates, then execs `vllm serve "$@"`.
ENTRYPOINT ["/opt/vllm-3x3090/entrypoint.sh"]
