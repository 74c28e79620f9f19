//! The Flight service: shared server state and the `FlightService` implementation that routes
//! each RPC to its handler and maps its error to a status once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arrow_flight::flight_descriptor::DescriptorType;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use bytes::Bytes;
use futures::stream::{self, BoxStream};
use futures::StreamExt;
use pocketflow_protocol::action::ActionName;
use pocketflow_protocol::limits::{MESSAGE_MAX_BYTES, STATS_INTERVAL_MS};
use pocketflow_protocol::token::TokenKey;
use pocketflow_protocol::ProtocolError;
use pocketflow_store::pins::PinTable;
use pocketflow_store::Store;
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::Authority;
use crate::bounds::{
    CONNECTION_IDLE_DEFAULT, EXCHANGE_SESSIONS_MAX, TRANSFERS_MAX, WAITS_PARKED_MAX,
};
use crate::doget_wire::FlightServer;
use crate::drain::Drain;
use crate::metrics::Metrics;
use crate::stats::Stats;
use crate::status::ServiceError;
use crate::{action, doget, doput, exchange};

/// What the service needs besides the store.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// Name of this server in statistics and messages.
    pub node_id: String,
    /// Key made from the cluster secret.
    pub token_key: TokenKey,
    /// How long a DoPut or DoGet may move nothing before it is ended (its slot given back).
    pub transfer_idle: Duration,
}

/// State shared by every request handler.
pub(crate) struct ServiceState {
    pub(crate) store: Store,
    pub(crate) auth: Authority,
    pub(crate) stats: Stats,
    pub(crate) metrics: Metrics,
    pub(crate) drain: Drain,
    pub(crate) node_id: String,
    pub(crate) transfers: Arc<Semaphore>,
    pub(crate) sessions: Arc<Semaphore>,
    pub(crate) waits: Arc<Semaphore>,
    pub(crate) transfer_idle: Duration,
    /// How long an HTTP/2 connection may carry no stream, in milliseconds (see
    /// [`StorageService::set_connection_idle`]).
    pub(crate) connection_idle_ms: AtomicU64,
    /// Pins of the shared DRAM arena; `None` when the store's arena is not shared.
    pub(crate) pins: Option<Arc<PinTable>>,
    /// Whether the shared arena's descriptor is handed out (its socket bound): until then, and
    /// for good if binding failed, PIN answers as a server without a shared arena.
    pub(crate) arena_served: std::sync::atomic::AtomicBool,
}

/// The pocketflow storage server's Flight service; clones share state.
#[derive(Clone)]
pub struct StorageService {
    pub(crate) state: Arc<ServiceState>,
}

impl StorageService {
    /// A service over `store`.
    pub fn new(store: Store, config: ServiceConfig) -> Self {
        let metrics = Metrics::new(&config.node_id, store.tier().as_str());
        let store_arena = store.shared_arena().map(|_| store.usage().capacity_bytes);
        let state = ServiceState {
            store,
            auth: Authority::new(config.token_key, config.node_id.clone()),
            stats: Stats::default(),
            metrics,
            drain: Drain::default(),
            node_id: config.node_id,
            transfers: Arc::new(Semaphore::new(TRANSFERS_MAX)),
            sessions: Arc::new(Semaphore::new(EXCHANGE_SESSIONS_MAX)),
            waits: Arc::new(Semaphore::new(WAITS_PARKED_MAX)),
            transfer_idle: config.transfer_idle,
            connection_idle_ms: AtomicU64::new(CONNECTION_IDLE_DEFAULT.as_millis() as u64),
            pins: crate::pin::table_for(&store_arena),
            arena_served: std::sync::atomic::AtomicBool::new(false),
        };
        Self {
            state: Arc::new(state),
        }
    }

    /// The service to hand tonic: the Flight service, with message sizes bounded by
    /// `MESSAGE_MAX_BYTES` both ways, and DoGet sent without copying its pieces
    /// (see [`crate::doget_wire`]).
    pub fn into_server(self) -> FlightServer {
        let state = self.state.clone();
        let generated = FlightServiceServer::new(self)
            .max_decoding_message_size(MESSAGE_MAX_BYTES)
            .max_encoding_message_size(MESSAGE_MAX_BYTES);
        FlightServer::new(generated, state)
    }

    /// Close HTTP/2 connections that carry no stream for `idle` (default
    /// [`CONNECTION_IDLE_DEFAULT`]); applies to connections served from now on.
    pub fn set_connection_idle(&self, idle: Duration) {
        self.state
            .connection_idle_ms
            .store(idle.as_millis() as u64, Ordering::Relaxed);
    }

    /// How long an HTTP/2 connection may carry no stream before it is closed.
    pub fn connection_idle(&self) -> Duration {
        Duration::from_millis(self.state.connection_idle_ms.load(Ordering::Relaxed))
    }

    /// Record the start-up self-test's figure (see [`crate::stats::Stats::set_measured_throughput`]).
    pub fn set_measured_throughput(&self, bytes_per_s: u64) {
        self.state.stats.set_measured_throughput(bytes_per_s);
    }

    /// Sample statistics every `STATS_INTERVAL_MS`, forever.
    pub async fn run_sampler(&self) {
        self.state
            .stats
            .run_sampler(Duration::from_millis(STATS_INTERVAL_MS))
            .await;
    }

    /// Resolve once a drain with `exit_when_empty` was requested and the store is empty.
    pub async fn drained_and_empty(&self, poll: Duration) {
        self.state
            .drain
            .wait_until_empty(&self.state.store, poll)
            .await;
    }
}

/// The CMD bytes of a descriptor, or why there are none.
pub(crate) fn descriptor_cmd(data: &FlightData) -> Result<Bytes, ServiceError> {
    match &data.flight_descriptor {
        Some(d) if d.r#type == DescriptorType::Cmd as i32 => Ok(d.cmd.clone()),
        _ => Err(ProtocolError::DescriptorMissing.into()),
    }
}

fn unimplemented(rpc: &str) -> Status {
    Status::unimplemented(format!("{rpc} is not part of the pocketflow protocol"))
}

#[tonic::async_trait]
impl FlightService for StorageService {
    type HandshakeStream = BoxStream<'static, Result<HandshakeResponse, Status>>;
    type ListFlightsStream = BoxStream<'static, Result<FlightInfo, Status>>;
    type DoGetStream = BoxStream<'static, Result<FlightData, Status>>;
    type DoPutStream = BoxStream<'static, Result<PutResult, Status>>;
    type DoExchangeStream = BoxStream<'static, Result<FlightData, Status>>;
    type DoActionStream = BoxStream<'static, Result<arrow_flight::Result, Status>>;
    type ListActionsStream = BoxStream<'static, Result<ActionType, Status>>;

    async fn handshake(
        &self,
        _request: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        Err(unimplemented(
            "Handshake (capability tokens travel in every request)",
        ))
    }

    async fn list_flights(
        &self,
        _request: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        Err(unimplemented("ListFlights"))
    }

    async fn get_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        Err(unimplemented("GetFlightInfo"))
    }

    async fn poll_flight_info(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        Err(unimplemented("PollFlightInfo"))
    }

    async fn get_schema(
        &self,
        _request: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        Err(unimplemented("GetSchema"))
    }

    /// DoGet through tonic's codec, which copies each piece into its buffer. `into_server`
    /// answers DoGet before it gets here ([`crate::doget_wire`]); this serves the same answer
    /// to a caller that serves `FlightServiceServer` itself.
    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        let started = std::time::Instant::now();
        let stream = doget::get(self.state.clone(), request.into_inner().ticket).await;
        self.state
            .metrics
            .outcome("do_get", "get", &stream, started);
        let stream = stream?.map(|answer| answer.map(doget::Answer::into_flight_data));
        Ok(Response::new(stream.boxed()))
    }

    async fn do_put(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        let started = std::time::Instant::now();
        let result = doput::put(self.state.clone(), request.into_inner()).await;
        self.state
            .metrics
            .outcome("do_put", "put", &result, started);
        let result = result?;
        Ok(Response::new(
            stream::once(async move { Ok(result) }).boxed(),
        ))
    }

    async fn do_exchange(
        &self,
        request: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        let stream = exchange::open(self.state.clone(), request.into_inner()).await?;
        Ok(Response::new(stream))
    }

    async fn do_action(
        &self,
        request: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        let action = request.into_inner();
        let started = std::time::Instant::now();
        let body = action::run(&self.state, &action.r#type, &action.body).await;
        let name = ActionName::from_name(&action.r#type).map_or("unknown", ActionName::as_str);
        self.state
            .metrics
            .outcome("do_action", name, &body, started);
        let body = body?;
        let result = arrow_flight::Result { body };
        Ok(Response::new(
            stream::once(async move { Ok(result) }).boxed(),
        ))
    }

    async fn list_actions(
        &self,
        _request: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        let actions: Vec<Result<ActionType, Status>> = ActionName::ALL
            .into_iter()
            .map(|a| {
                Ok(ActionType {
                    r#type: a.as_str().to_owned(),
                    description: a.description().to_owned(),
                })
            })
            .collect();
        Ok(Response::new(stream::iter(actions).boxed()))
    }
}
