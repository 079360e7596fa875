// Compile JSON Schemas with ajv (JSON Schema 2020-12, strict mode, with ajv-formats, as the MCP
// TypeScript SDK's validator has them) and try instances against them.
// stdin: {"<name>": {"schema": {...}, "valid": [...], "invalid": [...]}, ...}
// stdout: {"<name>": "<what ajv said>", ...} for every schema ajv refused or judged an instance
// otherwise than expected; exit status 1 if there is any.
import Ajv2020 from "ajv/dist/2020.js";
import addFormats from "ajv-formats";

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const cases = JSON.parse(Buffer.concat(chunks).toString("utf8"));
const problems = {};
for (const [name, { schema, valid = [], invalid = [] }] of Object.entries(cases)) {
  const ajv = new Ajv2020({ strict: true, allErrors: true });
  addFormats(ajv);
  let validate;
  try {
    validate = ajv.compile(schema);
  } catch (error) {
    problems[name] = String(error.message || error);
    continue;
  }
  for (const instance of valid) {
    if (!validate(instance)) problems[name] = `refused ${JSON.stringify(instance)}: ${ajv.errorsText(validate.errors)}`;
  }
  for (const instance of invalid) {
    if (validate(instance)) problems[name] = `accepted ${JSON.stringify(instance)}`;
  }
}
process.stdout.write(JSON.stringify(problems));
process.exit(Object.keys(problems).length ? 1 : 0);
