export { verify, WebhookVerificationError, DEFAULT_TOLERANCE_SECONDS } from "./verify.js";
export type { HeadersLike } from "./verify.js";
export { Client, VoiceToolsError, frames } from "./client.js";
export type { ClientOptions, FollowOptions, PendingRequest, ExecuteRequest, CallRecord, Json } from "./client.js";
export type * from "./types.js";
