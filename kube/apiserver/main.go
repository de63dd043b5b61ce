// Command pyk8sres-apiserver is a small but real Kubernetes API server for
// tests and demos. It composes upstream libraries (k8s.io/apiserver and
// k8s.io/apiextensions-apiserver, built from Debian's Go source packages):
//
//   - the apiextensions server (CustomResourceDefinitions + custom resources),
//   - a legacy "/api/v1" group with pods (+status, +binding), nodes (+status),
//     namespaces (+status), events, configmaps, secrets, serviceaccounts,
//   - rbac.authorization.k8s.io/v1 objects (stored only: nothing enforces them),
//   - admissionregistration.k8s.io/v1 webhook configurations, called by
//     upstream's ValidatingAdmissionWebhook / MutatingAdmissionWebhook
//     plugins (admission.go), and pods/resize for in-place resize,
//
// all stored in etcd through the generic registry with the watch cache, so
// resourceVersions, watches, bookmarks, 409 conflicts, 410 Gone, field and
// label selectors, all patch types and server-side apply behave as upstream.
//
// Authentication is anonymous and authorization always-allow: it listens on
// plain HTTP and must only be bound to a loopback address.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	noopoteltrace "go.opentelemetry.io/otel/trace/noop"
	extapiserver "k8s.io/apiextensions-apiserver/pkg/apiserver"
	extoptions "k8s.io/apiextensions-apiserver/pkg/cmd/server/options"
	extopenapi "k8s.io/apiextensions-apiserver/pkg/generated/openapi"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apiserver/pkg/authentication/request/anonymous"
	"k8s.io/apiserver/pkg/authorization/authorizerfactory"
	openapinamer "k8s.io/apiserver/pkg/endpoints/openapi"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/apiserver/pkg/util/compatibility"
	utilopenapi "k8s.io/apiserver/pkg/util/openapi"
	"k8s.io/apiserver/pkg/util/webhook"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	"k8s.io/kube-openapi/pkg/common"

	// Generated at build time by kube/build.sh (openapi-gen over k8s.io/api):
	// the OpenAPI models are what server-side apply and kubectl need.
	coreopenapi "pyk8sres/openapi"
)

func main() {
	klog.InitFlags(nil)
	bind := flag.String("bind-address", "127.0.0.1", "address to listen on (keep it on loopback: no authentication)")
	port := flag.Int("port", 8080, "plain HTTP port")
	etcdServers := flag.String("etcd-servers", "http://127.0.0.1:2379", "comma-separated etcd client URLs")
	etcdPrefix := flag.String("etcd-prefix", "/registry", "key prefix in etcd")
	compaction := flag.Duration("etcd-compaction-interval", 5*time.Minute, "how often the server compacts etcd (0 disables)")
	flag.Parse()

	if err := run(*bind, *port, *etcdServers, *etcdPrefix, *compaction); err != nil {
		fmt.Fprintf(os.Stderr, "pyk8sres-apiserver: %v\n", err)
		os.Exit(1)
	}
}

// allDefinitions merges the apiextensions OpenAPI models with the ones for
// core/v1, rbac/v1 and meta types generated at build time.
func allDefinitions(ref common.ReferenceCallback) map[string]common.OpenAPIDefinition {
	defs := extopenapi.GetOpenAPIDefinitions(ref)
	for k, v := range coreopenapi.GetOpenAPIDefinitions(ref) {
		defs[k] = v
	}
	return defs
}

func run(bind string, port int, etcdServers, etcdPrefix string, compaction time.Duration) error {
	addr := net.JoinHostPort(bind, strconv.Itoa(port))
	loopback := &rest.Config{Host: "http://" + addr, QPS: 200, Burst: 400}

	// One generic server config; the apiextensions codec is the default for
	// its own objects, core objects get their own RESTOptionsGetter below.
	etcdOpts := genericoptions.NewEtcdOptions(storagebackend.NewDefaultConfig(
		etcdPrefix, extapiserver.Codecs.LegacyCodec(extapiserver.Scheme.PrioritizedVersionsAllGroups()...)))
	etcdOpts.StorageConfig.Transport.ServerList = splitComma(etcdServers)
	etcdOpts.StorageConfig.CompactionInterval = compaction

	cfg := genericapiserver.NewRecommendedConfig(extapiserver.Codecs)
	cfg.ExternalAddress = addr
	cfg.EffectiveVersion = compatibility.DefaultBuildEffectiveVersion()
	cfg.MergedResourceConfig = extapiserver.DefaultAPIResourceConfigSource()
	cfg.MergedResourceConfig.EnableVersions(coreGroupVersions...)
	cfg.LoopbackClientConfig = loopback
	// Anonymous users, everything allowed: a local test server only.
	cfg.Authentication.Authenticator = anonymous.NewAuthenticator(nil)
	cfg.Authorization.Authorizer = authorizerfactory.NewAlwaysAllowAuthorizer()
	getDefs := utilopenapi.GetOpenAPIDefinitionsWithoutDisabledFeatures(allDefinitions)
	namer := openapinamer.NewDefinitionNamer(extapiserver.Scheme, coreScheme)
	cfg.OpenAPIConfig = genericapiserver.DefaultOpenAPIConfig(getDefs, namer)
	cfg.OpenAPIConfig.Info.Title = "pyk8sres-apiserver"
	cfg.OpenAPIV3Config = genericapiserver.DefaultOpenAPIV3Config(getDefs, namer)
	cfg.OpenAPIV3Config.Info.Title = "pyk8sres-apiserver"
	if err := etcdOpts.ApplyTo(&cfg.Config); err != nil {
		return err
	}
	authWrapper := webhook.NewDefaultAuthenticationInfoResolverWrapper(nil, nil, loopback, noopoteltrace.NewTracerProvider())
	if err := setupAdmission(cfg, loopback, authWrapper); err != nil {
		return fmt.Errorf("admission: %w", err)
	}

	extCfg := &extapiserver.Config{
		GenericConfig: cfg,
		ExtraConfig: extapiserver.ExtraConfig{
			CRDRESTOptionsGetter: extoptions.NewCRDRESTOptionsGetter(*etcdOpts, cfg.ResourceTransformers, cfg.StorageObjectCountTracker),
			ServiceResolver:      noServices{},
			AuthResolverWrapper:  authWrapper,
			MasterCount:          1,
		},
	}
	completed := extCfg.Complete()
	// apiextensions turns discovery off because kube-apiserver's aggregator
	// serves it; here this server is the only one, so it serves discovery.
	completed.GenericConfig.EnableDiscovery = true
	ext, err := completed.New(genericapiserver.NewEmptyDelegate())
	if err != nil {
		return fmt.Errorf("creating apiextensions server: %w", err)
	}
	server := ext.GenericAPIServer
	syncCRDGroupsIntoDiscovery(ext)

	// Core objects are stored with their own codec (same etcd, same prefix).
	coreEtcd := *etcdOpts
	coreEtcd.StorageConfig.Codec = coreCodecs.LegacyCodec(coreGroupVersions...)
	coreGetter := coreEtcd.CreateRESTOptionsGetter(
		&genericoptions.SimpleStorageFactory{StorageConfig: coreEtcd.StorageConfig}, cfg.ResourceTransformers)

	legacy, groups, err := buildCoreGroups(coreGetter)
	if err != nil {
		return err
	}
	if err := server.InstallLegacyAPIGroup(genericapiserver.DefaultLegacyAPIPrefix, legacy); err != nil {
		return fmt.Errorf("installing /api/v1: %w", err)
	}
	for _, g := range groups {
		if err := server.InstallAPIGroup(g); err != nil {
			return fmt.Errorf("installing %v: %w", g.PrioritizedVersions, err)
		}
	}

	server.AddPostStartHookOrDie("pyk8sres-standard-namespaces", func(hc genericapiserver.PostStartHookContext) error {
		// Retry until etcd answers; readyz stays red until this returns.
		return wait.PollUntilContextCancel(hc, time.Second, true, func(ctx context.Context) (bool, error) {
			if err := createStandardNamespaces(ctx); err != nil {
				klog.Warningf("%v (retrying)", err)
				return false, nil
			}
			return true, nil
		})
	})

	prepared := server.PrepareRun()

	// Plain HTTP: no certificates to generate or trust in tests.
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	httpServer := &http.Server{Handler: prepared.Handler, ReadHeaderTimeout: 30 * time.Second}
	go func() {
		if err := httpServer.Serve(ln); err != nil && err != http.ErrServerClosed {
			klog.Fatalf("serving: %v", err)
		}
	}()
	klog.Infof("pyk8sres-apiserver listening on http://%s (etcd %s)", addr, etcdServers)

	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	// Runs the post-start hooks (CRD controllers, informers); /readyz turns
	// ready once they are done.
	if _, _, err := prepared.NonBlockingRunWithContext(ctx, 5*time.Second); err != nil {
		return err
	}
	<-ctx.Done()
	klog.Infof("shutting down")
	shutdownCtx, done := context.WithTimeout(context.Background(), 5*time.Second)
	defer done()
	_ = httpServer.Shutdown(shutdownCtx)
	return nil
}

func splitComma(s string) []string {
	var out []string
	start := 0
	for i := 0; i <= len(s); i++ {
		if i == len(s) || s[i] == ',' {
			if i > start {
				out = append(out, s[start:i])
			}
			start = i + 1
		}
	}
	return out
}
