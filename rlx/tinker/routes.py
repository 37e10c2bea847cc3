"""The HTTP face of the Tinker-compatible service: the routes the ``tinker`` SDK calls, under
``/api/v1``, each answered by ``rlx.tinker.server.Service`` (FastAPI; ``python -m rlx.tinker``
serves it with uvicorn).

    api = app(Service(bases, workdir))

(No ``from __future__ import annotations`` here: FastAPI reads the routes' ``fastapi.Request``
annotations as objects.)
"""

from rlx.tinker import runs, wire
from rlx.tinker.server import Service
from rlx.tinker.training import ATTENTION, MLP, BadInput

REFUSED = {
    "create_custom_loss": "custom losses run on the client here: use forward_backward_custom",
    "copy_weights": "copying weights between training runs is not served",
    "save_weights_external": "external storage is not served; save_weights writes to this host",
    "join_sampling_session": "sampling sessions are per client here; create one instead",
    "retrieve_futures": "this service's client config leaves sample_use_retrieve_futures off: "
                        "poll each call with retrieve_future",
}
"""Calls the SDK knows that this service refuses, and why."""


def app(service: Service):
  """The FastAPI application serving ``service`` under ``/api/v1``."""
  import fastapi  # noqa: PLC0415 - an optional dependency (the tinker extra)
  from fastapi.responses import JSONResponse, Response  # noqa: PLC0415

  api = fastapi.FastAPI(title="rlx Tinker-compatible service")

  @api.middleware("http")
  async def check_key(request: fastapi.Request, call_next):
    if service.api_key is not None and request.url.path != "/api/v1/healthz":
      if request.headers.get("x-api-key") != service.api_key and request.headers.get(
          "authorization", "").removeprefix("Bearer ") != service.api_key:
        return JSONResponse({"error": "wrong or missing API key", "category": "user"}, 401)
    try:
      return await call_next(request)
    except (BadInput, wire.WireError, KeyError) as error:
      return JSONResponse({"error": str(error), "category": "user"}, 400)

  def answer(result):
    if isinstance(result, bytes):
      return Response(result, media_type=wire.PROTOBUF)
    return JSONResponse(result)

  async def body(request: fastapi.Request) -> dict:
    return await request.json()

  @api.get("/api/v1/healthz")
  async def healthz():
    return {"status": "ok"}

  @api.get("/api/v1/get_server_capabilities")
  async def capabilities():
    return {"supported_models": [{"model_name": name, "max_context_length": base.max_length,
                                  "trainable": True, "sampleable": True}
                                 for name, base in service.bases.items()]}

  @api.post("/api/v1/client/config")
  async def client_config(request: fastapi.Request):
    return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False,
            "sample_use_retrieve_futures": False}

  @api.post("/api/v1/client/dynamic_config")
  async def dynamic_config(request: fastapi.Request):
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": True}

  @api.post("/api/v1/telemetry")
  async def telemetry(request: fastapi.Request):
    return {"status": "accepted"}

  @api.post("/api/v1/create_session")
  async def create_session(request: fastapi.Request):
    sent = await request.body()
    metadata = (await body(request)).get("user_metadata") if sent else None
    return {"type": "create_session", "session_id": service.create_session(metadata)}

  @api.get("/api/v1/sessions")
  async def sessions(limit: int = 20, offset: int = 0):
    return {"sessions": list(reversed(service.sessions))[offset:offset + limit]}  # newest first

  @api.get("/api/v1/sessions/{session_id}")
  async def session(session_id: str):
    found = service._session(session_id)
    return {"training_run_ids": list(found.adapters), "sampler_ids": list(found.samplers),
            "user_metadata": found.user_metadata}

  @api.post("/api/v1/session_heartbeat")
  async def heartbeat(request: fastapi.Request):
    service.heartbeat((await body(request))["session_id"])
    return {"type": "session_heartbeat"}

  @api.post("/api/v1/sessions/{session_id}/finish")
  async def finish(session_id: str):
    service.finish(session_id)
    return JSONResponse(None)

  @api.post("/api/v1/create_model")
  async def create_model(request: fastapi.Request):
    return service.create_model(await body(request))

  @api.post("/api/v1/get_info")
  async def get_info(request: fastapi.Request):
    return service.get_info((await body(request))["model_id"])

  @api.post("/api/v1/forward_backward")
  async def forward_backward(request: fastapi.Request):
    return service.forward_backward(await request.body())

  @api.post("/api/v1/optim_step")
  async def optim_step(request: fastapi.Request):
    return service.optim_step(await body(request))

  @api.post("/api/v1/save_weights")
  async def save_weights(request: fastapi.Request):
    return service.save_weights(await body(request))

  @api.post("/api/v1/save_weights_for_sampler")
  async def save_weights_for_sampler(request: fastapi.Request):
    return service.save_weights(await body(request), for_sampler=True)

  @api.post("/api/v1/load_weights")
  async def load_weights(request: fastapi.Request):
    return service.load_weights(await body(request))

  @api.post("/api/v1/create_sampling_session")
  async def create_sampling_session(request: fastapi.Request):
    return {"type": "create_sampling_session",
            "sampling_session_id": service.create_sampling_session(await body(request))}

  @api.get("/api/v1/samplers/{sampling_session_id}")
  async def sampler_info(sampling_session_id: str):
    return service.sampler_info(sampling_session_id)

  @api.post("/api/v1/asample")
  async def asample(request: fastapi.Request):
    return service.sample(await body(request))

  # -- training runs and checkpoints (the SDK's RestClient) --------------------------------------

  @api.get("/api/v1/training_runs")
  async def training_runs(limit: int = 20, offset: int = 0):
    service.expire()
    return service.runs.training_runs(limit, offset)

  @api.get("/api/v1/training_runs/{model_id}")
  async def training_run(model_id: str):
    service.expire(model_id)
    return service.runs.training_run(model_id)

  @api.get("/api/v1/training_runs/{model_id}/checkpoints")
  async def checkpoints(model_id: str):
    service.expire(model_id)
    return {"checkpoints": service.runs.checkpoints(model_id)}

  @api.post("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
  async def publish(model_id: str, checkpoint_id: str):
    service.runs.publish(model_id, checkpoint_id, public=True)
    return JSONResponse(None)

  @api.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
  async def unpublish(model_id: str, checkpoint_id: str):
    service.runs.publish(model_id, checkpoint_id, public=False)
    return JSONResponse(None)

  @api.put("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
  async def set_ttl(model_id: str, checkpoint_id: str, request: fastapi.Request):
    service.runs.set_ttl(model_id, checkpoint_id, (await body(request)).get("ttl_seconds"))
    return JSONResponse(None)

  @api.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
  async def delete_checkpoint(model_id: str, checkpoint_id: str):
    service.runs.delete(model_id, checkpoint_id)
    service.samplers.pop(f"tinker://{model_id}/{checkpoint_id}", None)
    return JSONResponse(None)

  @api.post("/api/v1/weights_info")
  async def weights_info(request: fastapi.Request):
    base, config, _ = service._checkpoint((await body(request))["tinker_path"])
    return runs.weights_info(base.name, config.rank, config.targets, ATTENTION, MLP)

  @api.post("/api/v1/cancel_future")
  async def cancel_future(request: fastapi.Request):
    service.cancel((await body(request))["request_id"])
    return JSONResponse(None)

  @api.post("/api/v1/retrieve_future")
  async def retrieve_future(request: fastapi.Request):
    import asyncio  # noqa: PLC0415

    request_id = (await body(request))["request_id"]
    return answer(await asyncio.to_thread(service.retrieve, request_id))

  for name, why in REFUSED.items():
    async def refuse(request: fastapi.Request, name=name, why=why):
      return JSONResponse({"error": f"{name} is not served by rlx: {why}", "category": "user"},
                          400)
    api.post(f"/api/v1/{name}")(refuse)

  return api
