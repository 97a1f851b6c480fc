import pytest
import kmock
from tests.operator.conftest import DEPLOYMENTS, NAMESPACE
pytestmark = pytest.mark.asyncio

async def test_probe(cluster):
    cluster[DEPLOYMENTS]['post'] << 422 << {"kind": "Status", "message": "nope cpu"}
    r = await cluster.post(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments", json={"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"x","namespace":NAMESPACE}})
    print(r.status, await r.text())
    r = await cluster.post(f"/api/v1/namespaces/{NAMESPACE}/configmaps", json={"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"x","namespace":NAMESPACE}})
    print(r.status)
