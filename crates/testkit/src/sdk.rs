//! aws-sdk-s3 wired straight to an s3s service in this process: the SDK
//! signs and serializes each request as it would for a socket, and the
//! service parses, authenticates and answers it, with no TCP between them.
//!
//! Plug it in with `aws_sdk_s3::config::Builder::http_client(InProcess::from(service))`.
//! The endpoint URL still names the host the signature covers
//! (`http://localhost:9000` in our tests); nothing listens there.

use aws_smithy_runtime_api::client::http::{
    HttpClient, HttpConnector, HttpConnectorFuture, HttpConnectorSettings, SharedHttpConnector,
};
use aws_smithy_runtime_api::client::orchestrator::{HttpRequest, HttpResponse};
use aws_smithy_runtime_api::client::result::ConnectorError;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::body::SdkBody;
use s3s::service::S3Service;

/// The SDK's HTTP client and connector for one s3s service.
#[derive(Debug, Clone)]
pub struct InProcess(S3Service);

impl From<S3Service> for InProcess {
    fn from(service: S3Service) -> Self {
        InProcess(service)
    }
}

impl HttpClient for InProcess {
    fn http_connector(&self, _: &HttpConnectorSettings, _: &RuntimeComponents) -> SharedHttpConnector {
        SharedHttpConnector::new(self.clone())
    }
}

impl HttpConnector for InProcess {
    fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
        let service = self.0.clone();
        HttpConnectorFuture::new(async move {
            let mut request = request.try_into_http1x().map_err(|e| ConnectorError::user(Box::new(e)))?;
            // A socket client sends the Host header the signature covers;
            // the SDK leaves it to the client.
            if !request.headers().contains_key(http::header::HOST) {
                let host = request.uri().authority().map(|a| a.as_str().to_owned()).unwrap_or_default();
                let value = http::HeaderValue::try_from(host).map_err(|e| ConnectorError::user(Box::new(e)))?;
                request.headers_mut().insert(http::header::HOST, value);
            }
            let response = service.call(request.map(s3s::Body::http_body)).await.map_err(|e| {
                let e: Box<dyn std::error::Error + Send + Sync> = e.into();
                ConnectorError::other(e, None)
            })?;
            HttpResponse::try_from(response.map(SdkBody::from_body_1_x))
                .map_err(|e| ConnectorError::other(Box::new(e), None))
        })
    }
}
