// Validate KEDA objects with the schemas of KEDA's CRDs that @kubernetes-models/keda ships.
// stdin: [{"kind": "ScaledObject", ...}, ...]; stdout: {"<index> <kind>/<name>": "<what the schema said>", ...}
// for each object refused (an object of a kind it has no schema for is refused too); exit status 1 if any.
import { ScaledObject, ScaledJob, TriggerAuthentication } from "@kubernetes-models/keda/keda.sh/v1alpha1";

const kinds = { ScaledObject, ScaledJob, TriggerAuthentication };
const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const problems = {};
JSON.parse(Buffer.concat(chunks).toString("utf8")).forEach((object, index) => {
  const name = `${index} ${object.kind}/${object.metadata?.name}`;
  const Kind = kinds[object.kind];
  if (!Kind || object.apiVersion !== "keda.sh/v1alpha1") {
    problems[name] = `no KEDA schema for ${object.apiVersion} ${object.kind}`;
    return;
  }
  try {
    new Kind(object).validate();
  } catch (error) {
    problems[name] = String(error.message || error);
  }
});
process.stdout.write(JSON.stringify(problems));
process.exit(Object.keys(problems).length ? 1 : 0);
