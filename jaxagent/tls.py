"""The TLS context every HTTP client of a process shares: `httpx.AsyncClient(...,
verify=shared_tls())`.

httpx builds a verifying context for each client it makes, loading the CA certificates
(certifi's, or SSL_CERT_FILE's) each time: 47 ms on the event loop a client here. An
episode's environment client made so held a run's loop 1.2 s a step with 32 episodes on
remote workers (`envs.loopwatch` blamed envs/server.py; a new user's round); one context,
made once, costs that once. Standard library and httpx only (env workers import it).
"""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.lru_cache(maxsize=None)
def shared_tls() -> ssl.SSLContext:
  """httpx's default verifying context (it honours SSL_CERT_FILE and SSL_CERT_DIR), made
  once a process."""
  return httpx.create_ssl_context()
